"""Helpers shared by the tests (on sys.path through pyproject.toml's `pythonpath`, as `support.*`):
tiny models built offline (`tiny_models`, `tiny_vlms`, `tiny_internlm2`, `quantized_models`), the
LMDeploy pipeline and HF reference helpers (`engine_helpers`), and a vendor with one wrong op
(`wrong_ops`)."""
