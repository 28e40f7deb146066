"""Test doubles shared by the tests (not part of the product): ``torch_sglang_server``, a torch-backed
stand-in for a GPU SGLang server."""
