"""Context parallelism over NCCL (trainer.context_parallel): the attention of samples split over two
GPUs against unsplit attention, forward and backward. Needs two GPUs: NCCL refuses two ranks on one."""

from __future__ import annotations

import orjson
import pytest

from tests.gpu.conftest import require_gpus
from tests.processes import run_module_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_split_attention_over_nccl_is_unsplit_attention(tmp_path):
    require_gpus(2)
    run_module_ranks("tests.integration.context_parallel_worker", 2, tmp_path, 1, "attention", gpus=True)
    for rank in (0, 1):
        gaps = orjson.loads((tmp_path / f"attention.{rank}.json").read_bytes())
        # fp32 on CUDA: the fused kernels' own rounding (TF32 is off for attention).
        assert max(gaps.values()) < 1e-4, (rank, gaps)
