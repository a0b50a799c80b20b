"""Tier 1: image-and-text prompt rows: both row shapes, references instead of pixels, every bad-image case."""

import base64
import io
import json
import pickle

import pytest
from PIL import Image
from yatt_lightning.datamodules.image_prompt import IMAGE_MARK, ImagePromptDataModule, read_image_jsonl
from yatt_lightning.datamodules.images import ImageError, ImageRef, clear_decoded, load_image


def _png(colour=(255, 0, 0), size=(8, 8)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def _inline(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _write(tmp_path, rows) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _dataset(path, **kwargs):
    dm = ImagePromptDataModule(path=path, batch_size=1, **kwargs)
    return dm.make_dataset(dm.load_rows())


def test_plain_and_chat_rows_carry_references_and_decode_on_use(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(_png((255, 0, 0)))
    blue = _png((0, 0, 255))
    path = _write(tmp_path, [
        {"prompt": "What colour?", "images": ["img/red.png"], "answer": "red"},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": _inline(blue)},
                                                   {"type": "text", "text": "What colour?"}]}], "answer": "blue"},
        {"prompt": f"Left {IMAGE_MARK} right {IMAGE_MARK}", "images": ["img/red.png", _inline(blue)]},
    ])  # fmt: skip
    rows = read_image_jsonl(tmp_path / "prompts.jsonl")
    assert [r["prompt"] for r in rows] == [f"{IMAGE_MARK}\nWhat colour?", f"{IMAGE_MARK}\nWhat colour?",
                                           f"Left {IMAGE_MARK} right {IMAGE_MARK}"]  # fmt: skip
    assert rows[1]["_images"] == [None], "inline data is not kept in memory after the line is read"
    assert rows[0]["answer"] == "red" and rows[0]["_source"].endswith("prompts.jsonl:1")
    ds = _dataset(path)
    first, second, third = ds[0], ds[1], ds[2]
    assert all(isinstance(ref, ImageRef) for r in (first, second, third) for ref in r["images"])
    assert len(pickle.dumps(second)) < 1000, "a row travels with a reference, not the pixels or the base64"
    assert load_image(first["images"][0]).getpixel((0, 0)) == (255, 0, 0)
    assert load_image(second["images"][0]).getpixel((3, 3)) == (0, 0, 255)  # read again from its line
    assert [ref.inline for ref in third["images"]] == [False, True]


def _bad_cases(tmp_path):
    (tmp_path / "notimage.png").write_text("hello, I am text")
    (tmp_path / "truncated.png").write_bytes(_png(size=(64, 64))[:60])
    (tmp_path / "big.png").write_bytes(_png(size=(300, 300)))
    (tmp_path / "ok.png").write_bytes(_png())
    return {
        "missing": ("gone.png", "does not exist (looked for", "fix the path"),
        "unreadable": ("notimage.png", "is not an image PIL can read", "replace the file"),
        "truncated": ("truncated.png", "is truncated or corrupt", "replace the file"),
        "oversized": ("big.png", "90000 pixels, over `data.max_image_pixels`=10000", "resize the image"),
        "bad base64": ("data:image/png;base64,@@@", "not valid base64", "re-encode"),
    }


@pytest.mark.parametrize("case", ["missing", "unreadable", "truncated", "oversized", "bad base64"])
def test_a_bad_image_is_an_error_naming_the_row_the_image_and_the_fix(case, tmp_path):
    image, what, fix = _bad_cases(tmp_path)[case]
    path = _write(tmp_path, [{"prompt": "ok", "images": ["ok.png"]}, {"prompt": "bad", "images": [image]}])
    ds = _dataset(path, max_image_pixels=10_000)
    ds[0]
    with pytest.raises(ImageError) as err:
        ds[1]
    message = str(err.value)
    assert message.startswith(f"{path}:2: ") and what in message and fix in message
    assert "`data.on_bad_image: skip`" in message


def test_an_image_over_the_byte_limit_names_the_key(tmp_path):
    (tmp_path / "ok.png").write_bytes(_png(size=(64, 64)))
    ds = _dataset(_write(tmp_path, [{"prompt": "x", "images": ["ok.png"]}]), max_image_bytes=50)
    with pytest.raises(ImageError, match=r"bytes, over `data.max_image_bytes`=50"):
        ds[0]


def test_skip_replaces_every_bad_row_with_the_next_good_one_and_counts(tmp_path):
    cases = _bad_cases(tmp_path)
    rows = [{"prompt": "good", "images": ["ok.png"], "n": 0}]
    rows += [{"prompt": name, "images": [image]} for name, (image, _, _) in cases.items()]
    ds = _dataset(_write(tmp_path, rows), on_bad_image="skip", max_image_pixels=10_000)
    drawn = [ds[i] for i in range(len(ds))]
    assert [r["prompt"] for r in drawn] == [f"{IMAGE_MARK}\ngood"] * len(ds)  # every bad row: the next good (wraps)
    assert ds.skipped == len(cases)


def test_a_file_changed_after_it_was_checked_is_refused(tmp_path):
    (tmp_path / "ok.png").write_bytes(_png((1, 2, 3)))
    row = _dataset(_write(tmp_path, [{"prompt": "x", "images": ["ok.png"]}]))[0]
    (tmp_path / "ok.png").write_bytes(_png((9, 9, 9)))
    clear_decoded()
    with pytest.raises(ImageError, match="changed since the dataset was read"):
        load_image(row["images"][0])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": f"{IMAGE_MARK}{IMAGE_MARK}", "images": ["a.png"]}, "2 <image> marks for 1 images"),
        ({"images": ["a.png"]}, "needs a non-empty 'prompt' string or chat 'messages'"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "a message part must be"),
    ],
)
def test_malformed_rows_name_the_line(row, message, tmp_path):
    path = _write(tmp_path, [row])
    with pytest.raises(ValueError, match=message) as err:
        read_image_jsonl(tmp_path / "prompts.jsonl")
    assert str(err.value).startswith(f"{path}:1: ")


def test_the_colour_task_can_only_be_solved_by_looking(tmp_path):
    """Every row has the same text, so a text-only policy scores chance; the square's colour is the answer."""
    from collections import Counter

    from yatt_lightning.datamodules.tasks import COLOURS, ColourTask

    path = ColourTask(num_rows=64, seed=3).write(tmp_path / "colours")
    ds = _dataset(str(path))
    rows = [ds[i] for i in range(len(ds))]
    assert len({r["prompt"] for r in rows}) == 1
    counts = Counter(r["answer"] for r in rows)
    assert set(counts) == set(COLOURS) and max(counts.values()) / len(rows) < 0.4  # no colour dominates
    for r in rows:
        colours = sorted(load_image(r["images"][0]).getcolors(maxcolors=4096), reverse=True)  # (count, rgb)
        dominant = next(rgb for _, rgb in colours if rgb != (128, 128, 128))
        distance = {c: sum(abs(a - b) for a, b in zip(COLOURS[c], dominant, strict=True)) for c in COLOURS}
        assert min(distance, key=distance.get) == r["answer"]
    assert ColourTask(num_rows=64, seed=3).write(tmp_path / "colours") == path  # written once


def test_the_vision_shim_refuses_versions_it_was_not_checked_with(monkeypatch):
    from yatt_lightning.multimodal import vision_shim

    assert vision_shim.needed(), "this CPU stack has no torchvision (../shared/CPU-STACK.md)"
    monkeypatch.setitem(vision_shim.PINNED, "transformers", "0.0.1")
    with pytest.raises(RuntimeError, match=r"checked with transformers==0.0.1, found 5\."):
        vision_shim.install()


def test_collapsing_expanded_image_tokens_restores_one_per_image_also_for_adjacent_images():
    from yatt_lightning.multimodal.image_inputs import collapse

    img, per = 9, 4
    assert collapse([1, *[img] * per, 2, 3], img, per) == [1, img, 2, 3]
    assert collapse([*[img] * (2 * per), 5], img, per) == [img, img, 5]  # two images side by side
    with pytest.raises(ValueError, match="run of 3 image tokens is not a whole number of 4-token images"):
        collapse([img, img, img], img, per)
    # Qwen-VL: each image its own count, between vision marks (7, 8): a run is one image
    assert collapse([1, 7, *[img] * 6, 8, 2, 7, *[img] * 8, 8], img, None) == [1, 7, img, 8, 2, 7, img, 8]


def test_a_qwen_vl_image_takes_one_token_per_merged_patch_of_its_own_size(tmp_path):
    """Dynamic resolution: the processor resizes each image to multiples of 28 px (14 px patches merged 2x2);
    the policy's prompt holds that many placeholders per image, in order, and its micro-batch the patches and
    grids the vision tower takes."""
    from yatt_lightning.datamodules.images import ImageLimits, reference

    from tests.user_models import build
    from yatt_lightning.multimodal.image_inputs import ImageInputs, collapse

    inputs = ImageInputs(build("qwen2.5-vl", tmp_path / "qwen"))
    sizes = [(84, 56), (56, 112)]  # (width, height): 3 x 2 and 2 x 4 merged patches
    refs = []
    for i, size in enumerate(sizes):
        (tmp_path / f"{i}.png").write_bytes(_png(size=size))
        refs.append(reference(f"{i}.png", base=tmp_path / "rows.jsonl", where=f"rows.jsonl:{i + 1}", index=0,
                              limits=ImageLimits(max_bytes=1 << 20, max_pixels=1 << 20)))  # fmt: skip
    assert inputs.counts(refs) == [6, 8]
    tok = inputs.token_id
    ids = inputs.expand([1, tok, 2, tok, 3], refs)
    assert ids == [1, *[tok] * 6, 2, *[tok] * 8, 3] and collapse(ids, tok, None) == [1, tok, 2, tok, 3]
    fields = inputs.pixels([refs[:1], refs[1:]])
    assert fields["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4]]
    assert fields["pixel_values"].shape[0] == 24 + 32  # patches, 3 x 2 x 14 x 14 values each


def test_a_parquet_table_in_verls_layout_gives_the_jsonl_rows_and_reads_its_images_back_from_the_table(tmp_path):
    """geometry3k's layout (chat prompt with an ``<image>`` mark, ``datasets``' Image bytes, verl's answer column)
    read lazily: the same prompts, answers and image bytes (by hash) as the colour task's jsonl file, each image a
    reference into the table that is read back, hash-checked, where it is used."""
    from yatt_lightning.datamodules.image_prompt import ImageTableRows
    from yatt_lightning.datamodules.tasks import ColourTask

    from tests.helpers import colour_task_in_verls_layout

    table = colour_task_in_verls_layout(tmp_path / "colours.parquet", num_rows=8, seed=3)
    rows = ImagePromptDataModule(path=str(table), batch_size=1).load_rows()
    assert isinstance(rows, ImageTableRows) and len(rows) == 8
    from_table = _dataset(str(table))
    from_jsonl = _dataset(str(ColourTask(num_rows=8, seed=3).write(tmp_path / "jsonl")))
    for i in range(8):
        row, twin = from_table[i], from_jsonl[i]
        assert row["answer"] == twin["answer"] and row["data_source"] == "colours"
        assert row["messages"] == [{"role": "user", "content": f"{IMAGE_MARK}\ncolour:"}]
        (ref,), (twin_ref,) = row["images"], twin["images"]
        assert ref.sha256 == twin_ref.sha256 and (ref.row, ref.column, ref.index) == (i, "images", 0)
        assert len(pickle.dumps(row)) < 1000, "a row travels with a reference, not the image's bytes"
    clear_decoded()  # read back from the table now
    ref, twin_ref = from_table[5]["images"][0], from_jsonl[5]["images"][0]
    assert load_image(ref).tobytes() == load_image(twin_ref).tobytes()


def test_a_tables_image_paths_start_at_its_folder_and_its_bad_columns_and_rows_are_named(tmp_path):
    import datasets

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(_png((255, 0, 0)))
    table = tmp_path / "rows.parquet"
    datasets.Dataset.from_dict({
        "question": [f"{IMAGE_MARK} What colour?", "What colour?"], "images": [["img/red.png"], ["img/red.png"]],
        "label": ["red", "red"],
    }).to_parquet(str(table))  # fmt: skip
    ds = _dataset(str(table), prompt_key="question", answer_key="label")
    assert load_image(ds[0]["images"][0]).getpixel((0, 0)) == (255, 0, 0)
    assert ds[1]["prompt"] == f"{IMAGE_MARK}\nWhat colour?"  # a plain prompt without marks: its image in front
    with pytest.raises(ValueError, match=r"`data.images_key`: .*rows.parquet has no column 'pictures'"):
        _dataset(str(table), prompt_key="question", images_key="pictures")
    bad = tmp_path / "bad.parquet"
    two_marks = {"prompt": [f"{IMAGE_MARK}{IMAGE_MARK} Two?"], "images": [["img/red.png"]]}
    datasets.Dataset.from_dict(two_marks).to_parquet(str(bad))
    with pytest.raises(ValueError, match=r"bad.parquet row 0: the prompt has 2 <image> marks for 1 images"):
        _dataset(str(bad))[0]
