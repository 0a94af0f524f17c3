"""Native kernels for RNN, GRU and LSTM (reference: compiler_core/graph/ops/recurrent.py).

Each direction is one `te.recurrence`: a loop over the steps carrying the hidden (and cell)
state, so the kernel's size does not depend on the sequence length. Before the loop, the
input projection of every step is one GEMM stage (W packed into panels at build time); in the
loop, the hidden-state product is another (R packed the same way), both scheduled by the
dense template in float32 as ORT computes them; the gates and the state update run in
float32 as well (float64 for a float64 model). Batch entries past their `sequence_lens` keep
their state and emit zeros, and a reverse direction walks each entry's own prefix backwards."""

from __future__ import annotations

from collections.abc import Callable

from compiler_core.graph.ir import Node
from compiler_core.graph.ops.recurrent import DEFAULT_ACTIVATIONS, GATES, num_directions
from compiler_core.kernels.base import Builder, KernelContext
from compiler_core.kernels.nn import constant_product, packed_panels
from compiler_core.loop.ir import INDEX, Binary, Cast, Const, Expr, Select, Unary, maximum, minimum
from compiler_core.te import Tensor, compute, recurrence, reduce_axis, reduce_sum

F32 = "float32"


def _c(value: float, dtype: str) -> Expr:
    return Const(float(value), dtype)


def _sigmoid(x, a, b):
    return _c(0.5, x.dtype) * (_c(1.0, x.dtype) + Unary("tanh", _c(0.5, x.dtype) * x))


ACTIVATIONS: dict[str, Callable[[Expr, float, float], Expr]] = {
    "Relu": lambda x, a, b: maximum(x, _c(0.0, x.dtype)),
    "Tanh": lambda x, a, b: Unary("tanh", x),
    "Sigmoid": _sigmoid,
    "Affine": lambda x, a, b: _c(a, x.dtype) * x + _c(b, x.dtype),
    "LeakyRelu": lambda x, a, b: Select(x >= _c(0.0, x.dtype), x, _c(a, x.dtype) * x),
    "ThresholdedRelu": lambda x, a, b: Select(x >= _c(a, x.dtype), x, _c(0.0, x.dtype)),
    "ScaledTanh": lambda x, a, b: _c(a, x.dtype) * Unary("tanh", _c(b, x.dtype) * x),
    "HardSigmoid": lambda x, a, b: minimum(
        maximum(_c(a, x.dtype) * x + _c(b, x.dtype), _c(0.0, x.dtype)), _c(1.0, x.dtype)
    ),
    "Elu": lambda x, a, b: Select(
        x >= _c(0.0, x.dtype),
        x,
        _c(a, x.dtype) * (Unary("exp", minimum(x, _c(0.0, x.dtype))) - _c(1.0, x.dtype)),
    ),
    "Softsign": lambda x, a, b: x / (_c(1.0, x.dtype) + Unary("abs", x)),
    "Softplus": lambda x, a, b: (
        maximum(x, _c(0.0, x.dtype))
        + Unary("log", _c(1.0, x.dtype) + Unary("exp", -Unary("abs", x)))
    ),
}


class _Inline:
    """An elementwise intermediate read like a tensor, `value[(b, j)]`, but substituted."""

    def __init__(self, body: Callable[..., Expr]):
        self.body = body

    def __getitem__(self, index) -> Expr:
        return self.body(*index)


class _Recurrence:
    def __init__(self, ctx: KernelContext, node: Node):
        self.ctx, self.node = ctx, node
        self.layout = node.attr("layout", 0)
        x_type = ctx.type(node.inputs[0])
        self.steps, self.batch = (
            (x_type.shape[1], x_type.shape[0]) if self.layout else x_type.shape[:2]
        )
        self.hidden = node.attr("hidden_size")
        self.gates = GATES[node.op]
        # Gates and state updates compute in float32, as ONNX Runtime does (float32 tanh and
        # sigmoid expand to vectorized polynomials; float64 ones are a libm call per
        # element), or in float64 for a float64 model.
        self.dtype = "float64" if x_type.dtype == "float64" else F32
        self.x = ctx.tensor(node.inputs[0])
        self.w, self.r = ctx.tensor(node.inputs[1]), ctx.tensor(node.inputs[2])
        self.bias = self.optional(3)
        self.lengths = self.optional(4)
        self.peepholes = self.optional(7) if node.op == "LSTM" else None

    def optional(self, index: int) -> Tensor | None:
        inputs = self.node.inputs
        return self.ctx.tensor(inputs[index]) if len(inputs) > index and inputs[index] else None

    def c(self, value: float) -> Expr:
        return _c(value, self.dtype)

    def stage(self, shape, body, dtype=None) -> Tensor:
        return compute(shape, body, self.ctx.stage_name(self.node), dtype or self.dtype)

    def inline(self, shape, body) -> _Inline:
        """An intermediate the default schedule would inline anyway: built as an expression
        directly, it spares the schedule one stage to inline (and verify) per use."""
        return _Inline(body)

    def kept_stage(self, shape, body, dtype=None) -> Tensor:
        """A stage the default schedule keeps in memory instead of inlining (a value read
        many times over: inlined, it would be recomputed at every read)."""
        tensor = self.stage(shape, body, dtype)
        self.ctx.note(tensor.name, materialize=True)
        return tensor

    # --- indexing -----------------------------------------------------------------------------

    def length(self, b) -> Expr:
        if self.lengths is None:
            return Const(self.steps, INDEX)
        return minimum(Cast(INDEX, self.lengths[(b,)]), Const(self.steps, INDEX))

    def time_of(self, step, b, backward: bool) -> Expr:
        """The time index a direction's `step` reads: reverse walks each entry's prefix."""
        if not backward:
            return step
        n = self.length(b)
        return Select(step < n, n - Const(1, INDEX) - step, step)

    def x_at(self, t, b, k) -> Expr:
        return Cast(self.dtype, self.x[(b, t, k) if self.layout else (t, b, k)])

    def bias_at(self, d, row, recurrent: bool) -> Expr:
        if self.bias is None:
            return self.c(0.0)
        offset = self.gates * self.hidden if recurrent else 0
        return Cast(self.dtype, self.bias[(d, row + Const(offset, INDEX))])

    def initial(self, index: int, d) -> Tensor:
        given = self.optional(index)

        def body(b, j):
            if given is None:
                return self.c(0.0)
            return Cast(self.dtype, given[(b, d, j) if self.layout else (d, b, j)])

        return self.stage((self.batch, self.hidden), body)

    # --- one direction ------------------------------------------------------------------------

    def activations(self, d: int):
        node, per = self.node, len(DEFAULT_ACTIVATIONS[self.node.op])
        names = node.attr("activations")[d * per : (d + 1) * per]
        alphas = node.attr("activation_alpha")[d * per : (d + 1) * per]
        betas = node.attr("activation_beta")[d * per : (d + 1) * per]
        clip = node.attr("clip", None)

        def make(name, alpha, beta):
            def apply(x):
                if clip is not None:
                    x = minimum(maximum(x, self.c(-clip)), self.c(clip))
                return ACTIVATIONS[name](x, alpha, beta)

            return apply

        return [make(*spec) for spec in zip(names, alphas, betas, strict=True)]

    def projection(self, d: int, backward: bool):
        """x_t W^T for every step, read as `projected(s, b, row)` (float64): with a constant
        W, one GEMM stage over all steps' rows ([steps * batch, gates * hidden], the dense
        template), else a plain reduction."""
        size, w_value = self.w.shape[2], self.node.inputs[1]
        columns = self.gates * self.hidden

        def x_row(s, b, k):
            return self.x_at(self.time_of(s, b, backward), b, k)

        if not self.ctx.is_constant(w_value):

            def body(s, b, row):
                k = reduce_axis(size, "rk")
                w = Cast(self.dtype, self.w[(Const(d, INDEX), row, k)])
                return reduce_sum(x_row(s, b, k) * w, k)

            plain = self.stage((self.steps, self.batch, columns), body)
            return lambda s, b, row: plain[(s, b, row)]
        weights = self.ctx.constant(w_value)[d].T.astype(F32)
        panels, width = packed_panels(self.ctx, w_value, f"input{d}_panel{{}}", weights)
        batch = Const(self.batch, INDEX)
        rows = self.steps * self.batch

        def a_row(i, k):  # each step's inputs in the order the direction reads them
            s, b = Binary("floordiv", i, batch), Binary("mod", i, batch)
            return Cast(F32, x_row(s, b, k))

        a = self.stage((rows, size), a_row, dtype=F32)
        product = constant_product(
            self.ctx, self.node, lambda i, k: a[(i, k)], rows, panels, width, columns
        )
        return lambda s, b, row: Cast(self.dtype, product[(s * batch + b, row)])

    def recurrent_product(self, d: int, h, first_row: int, rows: int, scale=None) -> Tensor:
        """(h [* scale]) R^T over `rows` gate rows starting at `first_row`: a GEMM stage by
        R's rows packed at build time when R is a constant (the dense template's register
        tiles; ORT's float32 arithmetic), else a plain reduction."""
        r_value = self.node.inputs[2]

        def a_value(b, m):
            return h[(b, m)] if scale is None else h[(b, m)] * scale[(b, m)]

        if not self.ctx.is_constant(r_value):

            def body(b, j):
                m = reduce_axis(self.hidden, "rm")
                row = j + Const(first_row, INDEX)
                return reduce_sum(
                    a_value(b, m) * Cast(self.dtype, self.r[(Const(d, INDEX), row, m)]), m
                )

            return self.stage((self.batch, rows), body)
        weights = self.ctx.constant(r_value)[d, first_row : first_row + rows, :].T
        label = f"recurrent{d}_{first_row}_{rows}_panel{{}}"
        panels, width = packed_panels(self.ctx, r_value, label, weights.astype(F32))
        a = self.kept_stage(
            (self.batch, self.hidden), lambda b, m: Cast(F32, a_value(b, m)), dtype=F32
        )
        return constant_product(
            self.ctx, self.node, lambda i, m: a[(i, m)], self.batch, panels, width, rows
        )

    def run(self, d: int, backward: bool) -> list[Tensor]:
        """Direction d's states [steps, batch, hidden] (h, and c for an LSTM): row s is the
        state after step s. One loop over the steps carries them; an entry past its length
        keeps its state."""
        dd = Const(d, INDEX)
        acts = self.activations(d)
        projected = self.projection(d, backward)
        inits = [self.initial(5, dd)] + ([self.initial(6, dd)] if self.node.op == "LSTM" else [])
        cell = {"RNN": self.rnn_step, "GRU": self.gru_step, "LSTM": self.lstm_step}[self.node.op]

        def step(s, previous):
            # The previous states as stages of the step: the recurrent product reads each
            # element once per gate row, and a copy spares it the first-step test every time.
            states = [
                self.kept_stage((self.batch, self.hidden), lambda b, j, p=p: p[(b, j)])
                for p in previous
            ]
            new = cell(d, s, projected, states, acts)
            return [
                lambda b, j, n=n, o=o: Select(s < self.length(b), n[(b, j)], o[(b, j)])
                for n, o in zip(new, states, strict=True)
            ]

        return recurrence(self.steps, inits, step, f"{self.ctx.stage_name(self.node)}_d{d}")

    def gate(self, d, s, projected, hh, g, b, j) -> Expr:
        """Pre-activation of gate g: projected + recurrent product + both biases."""
        row = j + Const(g * self.hidden, INDEX)
        value = projected(s, b, row) + self.bias_at(Const(d, INDEX), row, False)
        return value + Cast(self.dtype, hh[(b, row)]) + self.bias_at(Const(d, INDEX), row, True)

    def rnn_step(self, d, s, projected, states, acts):
        (h,) = states
        hh = self.recurrent_product(d, h, 0, self.hidden)
        (f,) = acts
        return [
            self.inline(
                (self.batch, self.hidden), lambda b, j: f(self.gate(d, s, projected, hh, 0, b, j))
            )
        ]

    def gru_step(self, d, s, projected, states, acts):
        (h,) = states
        f, g = acts
        hidden = self.hidden
        hh = self.recurrent_product(d, h, 0, 3 * hidden)
        z = self.inline(
            (self.batch, hidden), lambda b, j: f(self.gate(d, s, projected, hh, 0, b, j))
        )
        r = self.inline(
            (self.batch, hidden), lambda b, j: f(self.gate(d, s, projected, hh, 1, b, j))
        )
        dd = Const(d, INDEX)
        if self.node.attr("linear_before_reset", 0):

            def candidate_at(b, j):
                row = j + Const(2 * hidden, INDEX)
                x_h = projected(s, b, row) + self.bias_at(dd, row, False)
                return g(
                    x_h + r[(b, j)] * (Cast(self.dtype, hh[(b, row)]) + self.bias_at(dd, row, True))
                )

        else:
            reset_product = self.recurrent_product(d, h, 2 * hidden, hidden, scale=r)

            def candidate_at(b, j):
                row = j + Const(2 * hidden, INDEX)
                x_h = projected(s, b, row) + self.bias_at(dd, row, False)
                return g(
                    x_h + Cast(self.dtype, reset_product[(b, j)]) + self.bias_at(dd, row, True)
                )

        candidate = self.inline((self.batch, hidden), candidate_at)
        return [
            self.inline(
                (self.batch, hidden),
                lambda b, j: (self.c(1.0) - z[(b, j)]) * candidate[(b, j)] + z[(b, j)] * h[(b, j)],
            )
        ]

    def lstm_step(self, d, s, projected, states, acts):
        h, c = states
        f, g, act_h = acts
        hidden = self.hidden
        hh = self.recurrent_product(d, h, 0, 4 * hidden)

        def peephole(k, b, j, cell_value):
            if self.peepholes is None:
                return self.c(0.0)
            return (
                Cast(self.dtype, self.peepholes[(Const(d, INDEX), j + Const(k * hidden, INDEX))])
                * cell_value
            )

        def input_gate(b, j):
            return f(self.gate(d, s, projected, hh, 0, b, j) + peephole(0, b, j, c[(b, j)]))

        def new_cell(b, j):
            i = input_gate(b, j)
            if self.node.attr("input_forget", 0):
                forget = self.c(1.0) - i
            else:
                forget = f(self.gate(d, s, projected, hh, 2, b, j) + peephole(2, b, j, c[(b, j)]))
            return forget * c[(b, j)] + i * g(self.gate(d, s, projected, hh, 3, b, j))

        # A stage of the step: the hidden update reads it too (inlined, it recomputes the gates).
        cell = self.kept_stage((self.batch, hidden), new_cell)

        def new_hidden(b, j):
            o = f(self.gate(d, s, projected, hh, 1, b, j) + peephole(1, b, j, cell[(b, j)]))
            return o * act_h(cell[(b, j)])

        return [self.inline((self.batch, hidden), new_hidden), cell]


def _recurrent(ctx: KernelContext, node: Node):
    rec = _Recurrence(ctx, node)
    directions = num_directions(node)
    reverse_only = node.attr("direction", "forward") == "reverse"
    runs = [rec.run(d, reverse_only or d == 1) for d in range(directions)]
    dtype = ctx.type(next(v for v in node.outputs if v)).dtype
    last = Const(rec.steps - 1, INDEX)

    def by_direction(d, value_of) -> Expr:
        value = value_of(0)
        for k in range(1, directions):
            value = Select(Binary("eq", d, Const(k, INDEX)), value_of(k), value)
        return value

    def y_body(*i):
        t, d, b, j = (i[1], i[2], i[0], i[3]) if rec.layout else i

        def at(k):  # the step that read time t (a reverse direction reads it backwards)
            step = rec.time_of(t, b, reverse_only or k == 1)
            return runs[k][0][(step, b, j)]

        return Cast(dtype, Select(t < rec.length(b), by_direction(d, at), rec.c(0.0)))

    def final_body(state_index):
        def body(*i):
            d, b, j = (i[1], i[0], i[2]) if rec.layout else i
            # An entry keeps its state past its length: the last row is its final state.
            value = by_direction(d, lambda k: runs[k][state_index][(last, b, j)])
            return Cast(dtype, Select(Const(0, INDEX) < rec.length(b), value, rec.c(0.0)))

        return body

    bodies = [y_body, final_body(0), final_body(1)]
    return [
        compute(ctx.type(value).shape, bodies[index], ctx.stage_name(node), dtype)
        for index, value in enumerate(node.outputs)
        if value
    ]


KERNELS: dict[str, Builder] = {op: _recurrent for op in ("RNN", "GRU", "LSTM")}
