"""The whole training loop over 2 processes with FSDP x TP and with the pipeline (its one program, and
per-rank programs: each process one pp rank): tests/support/multiprocess_loop.py says what is checked."""

import pytest
from support.multiprocess_loop import check_two_processes_evaluate_checkpoint_resume_and_sample


@pytest.mark.slow  # 2 launches of 2 processes and a reference run: 2-5 min on 2 shared cores
@pytest.mark.parametrize("strategy", ["fsdp-tp", "pipeline", "pipeline-per-rank"])
def test_two_processes_evaluate_checkpoint_resume_and_sample(tmp_path, strategy):
    check_two_processes_evaluate_checkpoint_resume_and_sample(tmp_path, strategy)
