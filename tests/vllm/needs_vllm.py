"""Where vLLM does not import, the tests under tests/vllm skip and say why (`make test` runs
without vLLM; `make test-vllm` runs them in vLLM's CPU build's virtualenv, docs/vllm.md)."""

from __future__ import annotations

import pytest

try:
    import vllm  # noqa: F401

    MISSING = None
except Exception as e:  # not installed here, or its native parts do not load
    MISSING = (
        f"vLLM does not import here ({type(e).__name__}: {e}); run it with `make test-vllm` (docs/vllm.md)"
    )

needs_vllm = [pytest.mark.e2e, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]
