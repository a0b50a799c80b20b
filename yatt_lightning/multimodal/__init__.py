"""Vision-language inputs: image tokens and pixels of a policy, and the image-processor shim for CPU."""
