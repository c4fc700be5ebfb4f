"""Real 2-way context parallelism (two gloo processes on loopback): the adapter's roll against
megatron-core's ``roll_tensor`` on the same shards, and against the unsplit roll."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=37, suite="stage-a-cpu")

CP = 2
#: (cu_seqlens or None for one document per row, rows); documents are multiples of 2 * CP
CASES = [((0, 8, 20, 24), 1), ((0, 4), 1), ((0, 12, 16, 28, 32, 44), 1), (None, 3)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.multi_token_prediction import roll_tensor
    from miles_mtp.roll import LEFT, RIGHT, SequenceLayout, roll, shard

    from miles_core.hardware import activate

    activate().prepare("megatron")  # on the cpu backend megatron's CP roll allocates on torch.cuda.current_device()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=CP)
    try:
        group = dist.group.WORLD
        for index, (cu, batch) in enumerate(CASES):
            length = cu[-1] if cu else 16
            x = torch.randint(1, 1000, (batch, length), generator=torch.Generator().manual_seed(index))
            layout = SequenceLayout(cu, CP, rank)
            local = shard(x, layout)
            params = None if cu is None else PackedSeqParams(cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
            theirs, _ = roll_tensor(local, shifts=-1, dims=-1, cp_group=group, packed_seq_params=params)
            mine = roll(local, LEFT, layout, group)
            assert torch.equal(mine, theirs), (cu, rank, mine, theirs)
            for shift in (LEFT, RIGHT):
                unsplit = roll(x, shift, SequenceLayout(cu))
                assert torch.equal(roll(local, shift, layout, group), shard(unsplit, layout)), (
                    cu,
                    shift,
                    rank,
                )
    finally:
        dist.destroy_process_group()


def test_two_rank_roll_matches_megatron_and_the_unsplit_roll():
    mp.spawn(_worker, args=(_free_port(),), nprocs=CP, join=True)
