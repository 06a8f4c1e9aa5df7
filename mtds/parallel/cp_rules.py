"""Context parallelism's shape rules, once: the rulebook's (:mod:`mtds.rules.context`, which train.py, mtds-eval
and the planner ask), the kernels' own checks, mtds-eval's padding and the planner's search all ask here. Torch-free,
as the planner is.

- chunks: the sequence is cut into 2c equal chunks (causal load balancing, :mod:`mtds.cp.chunks`);
- sp_split: with --sequence-parallel each rank's s/c tokens are split again over the t TP ranks;
- a2a_heads: Ulysses' all-to-all splits the query and the KV heads of each TP rank over the c ranks.

A broken rule is a :class:`CPProblem`; ``train_message`` words it with the flags to change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

CHUNKS, SP_SPLIT, A2A_HEADS = "chunks", "sp_split", "a2a_heads"


@dataclass(frozen=True)
class CPProblem:
    rule: str                  # CHUNKS | SP_SPLIT | A2A_HEADS
    cp: int
    tp: int = 1
    seq_length: int = 0
    q_heads: int = 0           # per TP rank (A2A_HEADS)
    kv_heads: int = 0          # per TP rank (A2A_HEADS)

    def train_message(self) -> str:
        c, t, s = self.cp, self.tp, self.seq_length
        if self.rule == CHUNKS:
            return (f"--context-parallel-size {c} needs --seq-length divisible by 2*C = {2 * c} (causal load "
                    f"balancing: 2·C chunks), got {s}: use a multiple of {2 * c}")
        if self.rule == SP_SPLIT:
            return (f"--sequence-parallel with --cp {c} splits each rank's {s // c} tokens over --tp {t}: use a "
                    f"--seq-length divisible by {sequence_multiple(c, t, sequence_parallel=True)}")
        return (f"--cp-comm-type a2a needs the {self.q_heads} query heads per TP rank and {self.kv_heads} key/value "
                f"heads per TP rank divisible by C={c}: use --cp-comm-type p2p or a C dividing both")


def sequence_multiple(cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """What a sequence's length must be a multiple of at context-parallel size ``cp`` (all of the rules on
    it at once): 2c, and with sequence parallelism c·t too. 1 at c = 1 (sequence parallelism alone is
    the rulebook's sequence-parallel rule)."""
    if cp == 1:
        return 1
    return math.lcm(2 * cp, cp * tp) if sequence_parallel else 2 * cp


def chunks_problem(seq_length: int, cp: int) -> CPProblem | None:
    """The sequence does not cut into 2c equal chunks (never at c = 1)."""
    return CPProblem(CHUNKS, cp, seq_length=seq_length) if cp > 1 and seq_length % (2 * cp) else None


def heads_problem(q_heads: int, kv_heads: int, cp: int) -> CPProblem | None:
    """The query or KV heads of a TP rank (``q_heads``, ``kv_heads``) do not split evenly over c ranks."""
    if q_heads % cp or kv_heads % cp:
        return CPProblem(A2A_HEADS, cp, q_heads=q_heads, kv_heads=kv_heads)
    return None


def cp_shape_problems(*, cp: int, tp: int, seq_length: int, comm_type: str, sequence_parallel: bool,
                      num_heads: int, kv_heads: int) -> list[CPProblem]:
    """Every rule a (t, c) split of a model with ``num_heads`` / ``kv_heads`` heads (all TP ranks together)
    breaks at this sequence length, in the order above; the SP split is judged only on whole chunks."""
    if cp == 1:
        return []
    out = []
    chunks = chunks_problem(seq_length, cp)
    if chunks is not None:
        out.append(chunks)
    elif sequence_parallel and (seq_length // cp) % tp:
        out.append(CPProblem(SP_SPLIT, cp, tp, seq_length))
    if comm_type == "a2a":
        heads = heads_problem(num_heads // tp, kv_heads // tp, cp)
        out += [heads] if heads is not None else []
    return out
