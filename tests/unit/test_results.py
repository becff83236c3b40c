"""Result rendezvous: rows and finished requests meet in either order; the spool never hangs."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from hsx.engine.copier import read_spool_file, write_spool_file
from hsx.engine.results import ResultRendezvous, write_spool_error
from hsx.errors import EngineError

pytestmark = [pytest.mark.timeout(60)]


def _same_rows(key: str, tokens: int, rows: torch.Tensor) -> torch.Tensor:
    if rows.shape[0] != tokens:
        raise EngineError(f"request {key}: expected {tokens} rows, found {rows.shape[0]}")
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spool_file_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    rows = torch.randn(37, 3, 16).to(dtype)  # [tokens, K, H]
    write_spool_file(str(tmp_path), "c1-s2", rows)
    assert [p.name for p in tmp_path.iterdir()] == ["c1-s2.rows"]  # no temp file left
    back = read_spool_file(tmp_path / "c1-s2.rows")
    assert back.dtype == dtype and torch.equal(back, rows)


def test_rows_before_and_after_finish(tmp_path: Path) -> None:
    meet = ResultRendezvous(_same_rows)
    early: Future[torch.Tensor] = Future()
    meet.deliver("a", torch.zeros(4, 1, 2))
    meet.expect("a", 4, early)
    late: Future[torch.Tensor] = Future()
    meet.expect("b", 5, late)
    assert not late.done()
    meet.deliver("b", torch.zeros(3, 1, 2))
    assert early.result().shape == (4, 1, 2)
    with pytest.raises(EngineError, match="expected 5 rows, found 3"):
        late.result()


def test_spool_files_errors_and_a_file_that_never_comes(tmp_path: Path) -> None:
    meet = ResultRendezvous(_same_rows, spool_dir=str(tmp_path), spool_wait_limit_s=0.5)
    try:
        good: Future[torch.Tensor] = Future()
        failed: Future[torch.Tensor] = Future()
        broken: Future[torch.Tensor] = Future()
        missing: Future[torch.Tensor] = Future()
        write_spool_file(str(tmp_path), "good", torch.ones(2, 1, 4))
        write_spool_error(str(tmp_path), "failed", RuntimeError("device copy failed"))
        (tmp_path / "broken.rows").write_bytes(b"not a header")
        for key, future in [("good", good), ("failed", failed), ("broken", broken)]:
            meet.expect(key, 2, future)
        meet.expect("missing", 2, missing)
        assert torch.equal(good.result(timeout=10), torch.ones(2, 1, 4))
        with pytest.raises(EngineError, match="device copy failed"):
            failed.result(timeout=10)
        with pytest.raises(EngineError, match=r"broken\.rows could not be read"):
            broken.result(timeout=10)
        with pytest.raises(EngineError, match=r"did not appear in the spool .* within 0.5 s"):
            missing.result(timeout=10)
        assert meet.pending() == 0
    finally:
        meet.close()
