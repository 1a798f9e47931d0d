"""The loop's one collective per step on a CPU run: the step's mean of trained terms and the stop flag
travel in one all-reduce, with the values of the two separate all-reduces (launcher.rank.step_inputs)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import free_port

RANK = """
import json, os, signal, sys
import torch
from launcher.parallel.dims import init_process_group
from launcher.rank.preemption import StopSignal
from launcher.rank.step_inputs import agree

dist = init_process_group("cpu")
stop = StopSignal(("INT", "TERM"))
quiet = agree(dist, 5, stop)[1]  # no rank has received a signal yet
if dist.rank == 1:
    os.kill(os.getpid(), signal.SIGTERM)  # a real signal: the handler records it, the rank goes on
own = 10 + 7 * dist.rank  # unequal counts: rank 0 trains 10 tokens, rank 1 17
group = torch.distributed.distributed_c10d._get_default_group()
count = group._get_sequence_number_for_group  # the group's collectives so far
before = count()
separate = (dist.data_mean(own), stop.agreed(dist))
between = count()
terms, signum = agree(dist, own, stop)
collectives = [between - before, count() - between]
row = {"rank": dist.rank, "quiet": quiet, "terms": terms.item(), "collectives": collectives,
       "bitwise": bool(torch.equal(terms, separate[0])), "signum": signum, "separate": separate[1]}
with open(os.path.join(sys.argv[1], f"rank{dist.rank}.json"), "w") as out:  # one file each: stdout interleaves
    json.dump(row, out)
torch.distributed.barrier()
torch.distributed.destroy_process_group()  # a gloo group alive at interpreter exit may abort the rank
"""


def test_terms_and_a_stop_signal_on_one_rank_are_agreed_in_one_all_reduce(tmp_path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(script), str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in rows] == [0, 1], rows
    for row in rows:
        assert row["quiet"] is None
        assert row["collectives"] == [2, 1] and row["terms"] == 13.5 and row["bitwise"], row
        assert row["signum"] == row["separate"] == 15, row  # SIGTERM on rank 1 stops rank 0 too
