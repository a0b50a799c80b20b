# Two commands a newcomer needs (see README): `make run` and `make test`.
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: install run test test-fast lint

install:
	@bash scripts/install.sh

run: install
	$(VENV)/bin/yatt fit --config configs/grpo_tiny.yaml

test: install
	$(VENV)/bin/python -m pytest -n 2 --dist worksteal $(PYTEST_ARGS)

test-fast: install
	$(VENV)/bin/python -m pytest -n 2 --dist worksteal -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check yatt_lightning callbacks datamodules tests bench
