"""What the op-database sweep (``tests/test_op_db.py``, ``tests/op_db_sweep.py``) accepts
short of a checked, correct result: clear errors of ops that cannot do better yet
(``UNSUPPORTED``), the cases of known shardsci bugs (``KNOWN_BUGS``, to be fixed: an entry
that no longer matches fails the sweep, like a strict xfail), and ops whose values are random.

Keys are OpInfo names (``name`` or ``name.variant``), as in
``torch.testing._internal.common_methods_invocations.op_db``; sample numbers are indices into
``op.sample_inputs("cpu", torch.float64)`` as the sweep generates them (seeded by the key).
"""

import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Accepted:
    """Cases of one op the sweep accepts short of ``ok``: which, and what they must say.

    Attributes
    ----------
    message : str
        A regular expression the case's detail (``"TypeName: message"`` for an error), or
        each of a wrong case's problems, must match.
    reason : str
        Why: what the op cannot do yet, or the bug's name and description.
    samples : tuple of int, optional
        The samples it accepts (default: any).
    layouts : tuple of str, optional
        The sweep layouts on which it does (default: any).
    outcome : str
        ``"error"`` (a clear error on every rank) or, for a known bug, ``"gathered"``
        (an output replicated where it should be split, which the gather guard saw and
        ``gather_policy("error")`` refuses on every rank), ``"wrong"``, ``"unclear"`` or
        ``"some-ranks"``.
    """

    message: str
    reason: str
    samples: tuple[int, ...] | None = None
    layouts: tuple[str, ...] | None = None
    outcome: str = "error"

    def applies(self, record: dict) -> bool:
        """Whether ``record`` (a case of this entry's op) is one of its samples and layouts."""
        if self.samples is not None and record["sample"] not in self.samples:
            return False
        return self.layouts is None or record["layout"] in self.layouts

    def accepts(self, record: dict) -> bool:
        """Whether this entry accepts ``record``, a case of its op: a wrong or gathered case
        only if ``message`` matches each of its problems (so that a known wrong layout does
        not hide a new wrong gradient), any other case if it matches its detail."""
        if not self.applies(record) or record["outcome"] != self.outcome:
            return False
        if self.outcome not in ("wrong", "gathered"):
            return re.search(self.message, record["detail"]) is not None
        problems = re.split(r" \| |; rank \d+: |^rank \d+: ", record["detail"])
        return all(re.search(self.message, p) for p in problems if p)

    def __str__(self) -> str:
        samples = "any sample" if self.samples is None else f"samples {list(self.samples)}"
        layouts = "any layout" if self.layouts is None else "/".join(self.layouts)
        return f"{self.outcome} {self.message!r} on {samples}, {layouts}"


@dataclass(frozen=True)
class Bug:
    """A shardsci bug the sweep finds: what goes wrong and how its cases read."""

    name: str
    description: str
    outcome: str
    message: str

    def cases(
        self, samples: tuple[int, ...] | None = None, layouts: tuple[str, ...] | None = None
    ) -> Accepted:
        """The entry accepting this bug's cases among ``samples`` on ``layouts``."""
        return Accepted(
            self.message, f"{self.name}: {self.description}", samples, layouts, self.outcome
        )


_ADAPTIVE = (
    "an output size that does not divide a sharded dim's extent: adaptive windows of "
    "different lengths that overlap (the error says which output sizes work)"
)
_CHUNKED_LOSS = "a torch_nn custom op without a decomposition; no handler yet"
_NOT_STRIDED = "ShardTensors shard strided tensors only"
_RESIZE = "changes the storage in place; a shard cannot grow into its neighbour's elements"

#: A problem of a case whose output is replicated on a mesh axis where its cells'
#: dependencies state a split (NOTE [An output cell belongs to the shard it depends on] in
#: tests/expected_layouts.py).
GATHERED_LAYOUT = r"^output \d+: layout: mesh axis \d+ is R; expected "
#: An output replicated where its cells' dependencies state a sharded one: values and
#: gradients right, but every rank ends up holding the whole extent; not silently: the gather
#: guard saw it (warned under "warn") and refuses it on every rank under "error".
_GATHERED = Bug(
    "gathered output",
    "the output is Replicate on a mesh axis whose shards its cells depend on: a gather the "
    "guard reports (issue 20, item 2)",
    "gathered",
    GATHERED_LAYOUT,
)
#: Sorting along a sharded dim (``sort``, ``argsort``, ``msort``): values and gradients right.
_SORT_GATHERED = Bug(
    "sort along a sharded dim gathered",
    "no distributed sort (a sample sort exchanging only what moves): the sorted dim is "
    "replicated and sorted whole on every rank",
    "gathered",
    _GATHERED.message,
)
#: A factorisation or triangular solve over sharded matrix dims (``svd``, ``linalg.svd``,
#: ``triangular_solve``): values and gradients right.
_FACTORED_GATHERED = Bug(
    "sharded matrix gathered",
    "no distributed factorisation or triangular solve: a matrix split along its rows or "
    "columns is replicated and factored whole on every rank (batch dims keep their split)",
    "gathered",
    _GATHERED.message,
)
#: Ops whose every gathered case has one inherent reason, listed as one row per family in
#: ``docs/op_db_sweep.md`` (``tests/op_db_sweep.py``'s ``short_of_ok``), whatever entry (or
#: none, a later sample) accepts the case: family -> (reason, ops). Field models meet none of
#: these on a split field; a sort or an order statistic along a dim that is not split is local.
GATHERED_FAMILIES = {
    "factorisations, inverses, solves and spectra of a split matrix": (
        f"{_FACTORED_GATHERED.description}; a distributed factorisation (block-cyclic LU, "
        "QR or Cholesky, eigen- and singular-value solvers, as in ScaLAPACK) is not built",
        frozenset(
            [
                "cholesky",
                "geqrf",
                "linalg.cholesky",
                "linalg.cholesky_ex",
                "linalg.cond",
                "linalg.eig",
                "linalg.eigh",
                "linalg.eigvals",
                "linalg.eigvalsh",
                "linalg.householder_product",
                "linalg.inv",
                "linalg.inv_ex",
                "linalg.ldl_factor",
                "linalg.ldl_factor_ex",
                "linalg.ldl_solve",
                "linalg.lstsq",
                "linalg.lstsq.grad_oriented",
                "linalg.lu",
                "linalg.lu_factor",
                "linalg.lu_factor_ex",
                "linalg.lu_solve",
                "linalg.pinv",
                "linalg.pinv.hermitian",
                "linalg.qr",
                "linalg.solve",
                "linalg.svd",
                "linalg.svdvals",
                "lu",
                "lu_solve",
                "lu_unpack",
                "matrix_exp",
                "norm.nuc",
                "ormqr",
                "pca_lowrank",
                "pinverse",
                "qr",
                "svd",
                "svd_lowrank",
                "triangular_solve",
            ]
        ),
    ),
    "sorts along a split dim": (
        _SORT_GATHERED.description,
        frozenset({"sort", "argsort", "msort"}),
    ),
}
#: ``roll`` without dims (flat order) where a dim other than the leading one is sharded: the
#: shards are not runs of the flat order (with only the leading dim sharded, they are and the
#: layout is kept, ``_index_ops._roll_flattened``).
_FLAT_ROLL_GATHERED = Bug(
    "flat roll of a non-leading split gathered",
    "roll without dims of a tensor sharded along a dim other than the leading one is "
    "replicated (its shards are not runs of the flat order)",
    "gathered",
    _GATHERED.message,
)
#: An output sharded along another dim, or with other boundaries, than its cells'
#: dependencies state (values and gradients right).
_WRONG_LAYOUT = Bug(
    "wrong layout",
    "the output is sharded along another dim or with other boundaries than its cells' "
    "dependencies state, so the next op redistributes",
    "wrong",
    r"^output \d+: layout: ",
)
#: ``as_strided_scatter(x, src, size, stride, offset)`` writes ``src`` through strides over the
#: whole tensor's contiguous storage: where each written element lands (which rank's block) is
#: stride arithmetic over the global storage, not a layout of ``x``, and the source's gradient
#: is read back through ``as_strided`` (gathered too). Each rank could write the elements
#: landing in its block from a whole source with no communication; not built.
_STRIDED_GATHERED = Bug(
    "strided write over the whole storage gathered",
    "as_strided_scatter addresses the global storage by strides: x is gathered whole (one "
    "all-gather; the guard reports it), written, and returned replicated; its backward reads "
    "the gradient through as_strided, gathered alike",
    "gathered",
    _GATHERED.message,
)
#: A cell that two overlapping windows share (kernel > stride) read by max unpooling: its
#: dependencies give it to the rank whose window's maximum it is, which the indices' values
#: decide; the layout cannot depend on them and gives it to the later window's rank (NOTE in
#: shardsci/tensor/_ops/_unpool_ops.py), one cell per such boundary moved.
#: The errors each op may raise on sharded input. The sweep fails on an error no entry
#: accepts and on an entry that accepts no case where it applies.
UNSUPPORTED: dict[str, tuple[Accepted, ...]] = {
    "nn.functional.adaptive_avg_pool1d": (
        Accepted(
            r"^NotImplementedError: adaptive_avg_pool1d on a ShardTensor sharded along dim 2: the extent 8 is not",
            _ADAPTIVE,
            (0,),
            ("4r-empty", "4r-random", "2x2-uneven", "2x2-last"),
        ),
    ),
    "nn.functional.adaptive_avg_pool2d": (
        Accepted(
            r"^NotImplementedError: adaptive_avg_pool2d on a ShardTensor sharded along dim 1: the extent 8 is not",
            _ADAPTIVE,
            (1,),
            ("2x2-uneven", "2x2-last"),
        ),
        Accepted(
            r"^NotImplementedError: adaptive_avg_pool2d on a ShardTensor sharded along dim 2: the extent 8 is not",
            _ADAPTIVE,
            (0,),
            ("2x2-uneven", "2x2-last"),
        ),
        Accepted(
            r"^NotImplementedError: adaptive_avg_pool2d on a ShardTensor sharded along dim 2: the extent 8 is not",
            _ADAPTIVE,
            (1,),
            ("4r-empty", "4r-random"),
        ),
        Accepted(
            r"^NotImplementedError: adaptive_avg_pool2d on a ShardTensor sharded along dim 3: the extent 8 is not",
            _ADAPTIVE,
            (0,),
            ("4r-empty",),
        ),
        Accepted(
            r"^NotImplementedError: adaptive_avg_pool2d on a ShardTensor sharded along dim 3: the extent 8 is not",
            _ADAPTIVE,
            (2,),
            ("4r-empty", "2x2-last"),
        ),
    ),
    "nn.functional.adaptive_avg_pool3d": (
        Accepted(
            r"^NotImplementedError: adaptive_avg_pool3d on a ShardTensor sharded along dim 2: the extent 8 is not",
            _ADAPTIVE,
            (0,),
            ("2x2-uneven",),
        ),
        Accepted(
            r"^NotImplementedError: adaptive_avg_pool3d on a ShardTensor sharded along dim 3: the extent 8 is not",
            _ADAPTIVE,
            (0,),
            ("4r-random", "2x2-last"),
        ),
    ),
    "nn.functional.adaptive_max_pool1d": (
        Accepted(
            r"^NotImplementedError: adaptive_max_pool1d_with_indices on a ShardTensor sharded along dim 2: the",
            _ADAPTIVE,
            (0,),
            ("4r-empty", "4r-random", "2x2-last"),
        ),
    ),
    "nn.functional.adaptive_max_pool2d": (
        Accepted(
            r"^NotImplementedError: adaptive_max_pool2d_with_indices on a ShardTensor sharded along dim 3: the",
            _ADAPTIVE,
            (0,),
            ("4r-empty", "2x2-last"),
        ),
    ),
    "nn.functional.linear_cross_entropy.chunked": (
        Accepted(
            r"^NotImplementedError: shardsci: torch_nn\._linear_cross_entropy_batch_chunked\.default has no sharding",
            _CHUNKED_LOSS,
            (0,),
            ("2r-uneven", "4r-empty", "4r-random"),
        ),
        Accepted(
            r"^NotImplementedError: shardsci: torch_nn\._linear_cross_entropy_batch_chunked\.default has no sharding",
            _CHUNKED_LOSS,
            (1,),
            ("2x2-uneven", "2x2-last"),
        ),
    ),
    "nn.functional.linear_cross_entropy.chunked_none": (
        Accepted(
            r"^NotImplementedError: shardsci: torch_nn\._linear_cross_entropy_batch_chunked_no_reduction\.default",
            _CHUNKED_LOSS,
            (0,),
            ("2r-uneven", "4r-empty", "4r-random"),
        ),
        Accepted(
            r"^NotImplementedError: shardsci: torch_nn\._linear_cross_entropy_batch_chunked_no_reduction\.default",
            _CHUNKED_LOSS,
            (1,),
            ("2x2-uneven", "2x2-last"),
        ),
    ),
    "resize_": (
        Accepted(
            r"^NotImplementedError: shardsci: aten\.resize\.default has no sharding rule; register a handler with",
            _RESIZE,
            (0,),
            ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last"),
        ),
    ),
    "resize_as_": (
        Accepted(
            r"^NotImplementedError: shardsci: aten\.resize\.default has no sharding rule; register a handler with",
            _RESIZE,
            (0,),
            ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last"),
        ),
    ),
    "to_sparse": (
        Accepted(
            r"^NotImplementedError: shardsci: aten\._to_sparse\.default has no sharding rule; register a handler",
            _NOT_STRIDED,
            (0,),
            ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last"),
        ),
    ),
}

#: The cases of known shardsci bugs, op by op (see ``Bug``), found by the sweep of
#: every op's first sample on every layout: like strict xfails, each fails the sweep once
#: none of the cases it applies to shows its bug.
KNOWN_BUGS: dict[str, tuple[Accepted, ...]] = {
    "_chunk_cat": (_GATHERED.cases((0,), ("2r-uneven", "4r-empty", "2x2-uneven", "2x2-last")),),
    "_segment_reduce.lengths": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random")),
        _GATHERED.cases((30,), ("2x2-uneven", "2x2-last")),
    ),
    "_segment_reduce.offsets": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random")),
        _GATHERED.cases((30,), ("2x2-uneven", "2x2-last")),
    ),
    "argsort": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random")),
        _GATHERED.cases((1,), ("2x2-uneven",)),
        _SORT_GATHERED.cases((*range(1, 9), *range(25, 33), 56, 57), ("2r-uneven",)),
        _SORT_GATHERED.cases((*range(17, 25), *range(41, 49), 55), ("4r-empty",)),
        _SORT_GATHERED.cases(
            (5, 7, 12, 14, 20, 26, 27, 35, 37, 39, 40, 46, 47, 57), ("4r-random",)
        ),
        _SORT_GATHERED.cases((*range(2, 17), *range(25, 41), 56, 57), ("2x2-uneven",)),
        _SORT_GATHERED.cases((*range(9, 25), *range(33, 49), 55), ("2x2-last",)),
    ),
    "as_strided": (
        _GATHERED.cases((0,), ("4r-empty", "4r-random")),
        _GATHERED.cases((2,), ("2x2-uneven", "2x2-last")),
    ),
    "as_strided_copy": (_GATHERED.cases((0,), ("4r-empty", "4r-random")),),
    "as_strided_scatter": (
        _STRIDED_GATHERED.cases((0, 1), ("4r-empty", "4r-random")),
        _STRIDED_GATHERED.cases(
            (2, 3, 4), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")
        ),
        _STRIDED_GATHERED.cases((5, 6), ("2r-uneven", "4r-empty", "4r-random")),
    ),
    "block_diag": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty")),
        _GATHERED.cases((3,), ("2x2-uneven", "2x2-last")),
        _GATHERED.cases((1, 3), ("2r-uneven", "4r-empty")),
        _GATHERED.cases((3,), ("4r-random",)),
    ),
    "cholesky": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "geqrf": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "histogramdd": (_GATHERED.cases((0,), ("4r-empty", "2x2-uneven", "2x2-last")),),
    "linalg.cholesky": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.cholesky_ex": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.eig": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.eigh": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.householder_product": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.inv": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.inv_ex": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.ldl_factor": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.ldl_factor_ex": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.ldl_solve": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.lu": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.lu_factor": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.lu_factor_ex": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.pinv": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.pinv.hermitian": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.qr": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "linalg.solve": (_GATHERED.cases((0,), ("4r-random",)),),
    "linalg.svd": (
        _GATHERED.cases((32,), ("2x2-uneven", "2x2-last")),
        _FACTORED_GATHERED.cases(
            (*range(32, 40), *range(44, 48), *range(60, 72), *range(176, 192), *range(200, 216)),
            ("2r-uneven",),
        ),
        _FACTORED_GATHERED.cases(
            (
                *range(32, 40),
                *range(44, 48),
                *range(60, 72),
                *range(176, 184),
                *range(188, 192),
                *range(204, 216),
            ),
            ("4r-empty",),
        ),
        _FACTORED_GATHERED.cases(
            (
                *range(32, 40),
                *range(44, 48),
                *range(58, 72),
                *range(176, 184),
                *range(188, 192),
                *range(203, 216),
            ),
            ("4r-random",),
        ),
        _FACTORED_GATHERED.cases(
            (*range(33, 40), *range(44, 48), *range(60, 72), *range(176, 192), *range(200, 216)),
            ("2x2-uneven",),
        ),
        _FACTORED_GATHERED.cases(
            (
                *range(33, 40),
                *range(44, 48),
                *range(60, 72),
                *range(176, 184),
                *range(188, 192),
                *range(204, 216),
            ),
            ("2x2-last",),
        ),
    ),
    "lu": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "lu_solve": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "lu_unpack": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "matrix_exp": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "msort": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random")),
        _GATHERED.cases((1,), ("2x2-uneven",)),
        _SORT_GATHERED.cases((1,), ("2r-uneven", "4r-random")),
    ),
    "multinomial": (_GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random")),),
    "native_batch_norm": (
        Accepted(
            rf"{GATHERED_LAYOUT}|^the gather guard saw no gather$",
            "kept: the batch mean and inverse standard deviation (C,) are replicated over the "
            "axes sharding reduced dims, for every layout, where the dependency rule assigns "
            "them to the one rank holding every reduced cell (4r-random puts all of dim 2 on "
            "rank 2). Every rank needs them: they update the running statistics, plain buffers "
            "that every rank keeps identical (in place, in training); a layout giving them to "
            "one rank where the other shards happen to be empty would leave the others' "
            "buffers stale to save C numbers. Nothing is gathered: the output keeps its "
            "layout, the statistics are combined from each rank's per-channel sums (an "
            "all-reduce: the guard rightly says nothing)",
            (0,),
            ("4r-random",),
            "wrong",
        ),
    ),
    "nn.functional.ctc_loss": (_GATHERED.cases((0,), ("4r-random", "2x2-uneven", "2x2-last")),),
    "nn.functional.embedding_bag": (_GATHERED.cases((0,), ("4r-empty", "2x2-uneven", "2x2-last")),),
    "nn.functional.grid_sample": (
        _GATHERED.cases((0,), ("4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "nn.functional.pdist": (_GATHERED.cases((3,), ("2x2-uneven", "2x2-last")),),
    "ormqr": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "pca_lowrank": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "pinverse": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "qr": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "sort": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random")),
        _GATHERED.cases((1,), ("2x2-uneven",)),
        _SORT_GATHERED.cases((*range(1, 9), *range(25, 33), 56, 57), ("2r-uneven",)),
        _SORT_GATHERED.cases((*range(17, 25), *range(41, 49), 55), ("4r-empty",)),
        _SORT_GATHERED.cases(
            (1, 3, 10, 13, 15, 20, 24, 31, 32, 35, 37, 42, 44, 45, 47, 48, 56, 57), ("4r-random",)
        ),
        _SORT_GATHERED.cases((*range(2, 17), *range(25, 41), 56, 57), ("2x2-uneven",)),
        _SORT_GATHERED.cases((*range(9, 25), *range(33, 49), 55), ("2x2-last",)),
    ),
    "stft": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random")),
        _GATHERED.cases((3,), ("2x2-uneven", "2x2-last")),
        _GATHERED.cases((1, *range(3, 9)), ("2r-uneven",)),
        _GATHERED.cases((1, 3, *range(5, 9)), ("4r-empty",)),
        _GATHERED.cases((1, 3, 5, 8), ("4r-random",)),
        _GATHERED.cases((*range(5, 9),), ("2x2-uneven", "2x2-last")),
    ),
    "svd": (
        _GATHERED.cases((32,), ("2x2-uneven", "2x2-last")),
        _FACTORED_GATHERED.cases(
            (*range(32, 40), *range(56, 60), *range(64, 72), *range(176, 192), *range(200, 216)),
            ("2r-uneven",),
        ),
        _FACTORED_GATHERED.cases(
            (
                *range(32, 40),
                *range(56, 60),
                *range(64, 72),
                *range(176, 184),
                *range(200, 204),
                *range(208, 216),
            ),
            ("4r-empty",),
        ),
        _FACTORED_GATHERED.cases(
            (
                *range(32, 40),
                47,
                *range(56, 61),
                62,
                *range(64, 72),
                *range(176, 184),
                191,
                *range(200, 204),
                205,
                *range(208, 216),
            ),
            ("4r-random",),
        ),
        _FACTORED_GATHERED.cases(
            (*range(33, 40), *range(56, 60), *range(64, 72), *range(176, 192), *range(200, 216)),
            ("2x2-uneven",),
        ),
        _FACTORED_GATHERED.cases(
            (
                *range(33, 40),
                *range(56, 60),
                *range(64, 72),
                *range(176, 184),
                *range(200, 204),
                *range(208, 216),
            ),
            ("2x2-last",),
        ),
    ),
    "svd_lowrank": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last")),
    ),
    "take_along_dim": (
        Accepted(
            GATHERED_LAYOUT,
            "without a dim: gather along the flattened input through a smaller flat index. A "
            "cell-wise gather whose output has another extent than the input along the "
            "gathered dim is replicated over its axes (NOTE [A gather through a replicated "
            "index keeps the input's layout]) where, 1-D, it could hold each entry with its "
            "row's owner as index_select does (here all on one rank): a read through an index "
            "replicated, which the guard reports and refuses under 'error' "
            "(check_replicated_read)",
            (3,),
            ("2r-uneven", "4r-empty", "4r-random", "2x2-uneven", "2x2-last"),
            "gathered",
        ),
    ),
    "triangular_solve": (
        _GATHERED.cases((0,), ("2r-uneven", "4r-empty", "4r-random")),
        _GATHERED.cases((1,), ("2x2-uneven", "2x2-last")),
        _FACTORED_GATHERED.cases((1,), ("2r-uneven",)),
        _FACTORED_GATHERED.cases((1, *range(4, 8)), ("4r-empty", "4r-random")),
        _FACTORED_GATHERED.cases((4, 5), ("2x2-uneven",)),
        _FACTORED_GATHERED.cases((5, 7), ("2x2-last",)),
    ),
    "roll": (_FLAT_ROLL_GATHERED.cases((13,), ("4r-empty", "2x2-uneven", "2x2-last")),),
}

#: Ops whose outputs are random or uninitialised: the sharded run draws other numbers than one
#: process does, so only shapes, dtypes, shard sizes and layouts are compared, and the case
#: counts as not checked.
VALUES_NOT_COMPARED: dict[str, str] = {
    "bernoulli": "random",
    "cauchy": "random",
    "empty": "uninitialised",
    "empty_like": "uninitialised",
    "empty_permuted": "uninitialised",
    "empty_strided": "uninitialised",
    "exponential": "random",
    "geometric": "random",
    "log_normal": "random",
    "multinomial": "random",
    "new_empty": "uninitialised",
    "new_empty_strided": "uninitialised",
    "nn.functional.alpha_dropout": "random",
    "nn.functional.dropout": "random",
    "nn.functional.dropout2d": "random",
    "nn.functional.dropout3d": "random",
    "nn.functional.feature_alpha_dropout.with_train": "random",
    "nn.functional.rrelu": "random",
    "normal": "random",
    "normal.in_place": "random",
    "normal.number_mean": "random",
    "rand_like": "random",
    "randint": "random",
    "randint_like": "random",
    "randn": "random",
    "randn_like": "random",
    "uniform": "random",
}

#: Ops whose outputs are random in the samples a predicate picks (dropout inside): only those
#: samples' values go uncompared.
RANDOM_WHEN: dict[str, Callable[[object], bool]] = {
    "nn.functional.scaled_dot_product_attention": lambda s: s.kwargs.get("dropout_p", 0.0) > 0,
    # multi_head_attention_forward(query, key, value, ..., add_zero_attn, dropout_p, ...)
    "nn.functional.multi_head_attention_forward": (
        lambda s: s.kwargs.get("training", True) and s.args[9] > 0
    ),
}
