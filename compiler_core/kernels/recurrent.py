"""Native kernels for RNN, GRU and LSTM (reference: compiler_core/graph/ops/recurrent.py).

Tensor expressions have no loop-carried state, but the sequence length is static: the builder
unrolls the recurrence, one set of stages per time step and direction (the hidden-state
product is a reduction stage; the gates and the state update are elementwise stages reading
the previous step's state, which is kept in memory (noted `materialize`) so that the default
schedule does not inline the whole chain into each step). The input projection of
every step is one reduction stage per direction. Everything runs in float64, as the reference
does; batch entries past their `sequence_lens` keep their state and emit zeros, and a reverse
direction walks each entry's own prefix backwards.
"""

from __future__ import annotations

from collections.abc import Callable

from compiler_core.graph.ir import Node
from compiler_core.graph.ops.recurrent import DEFAULT_ACTIVATIONS, GATES, num_directions
from compiler_core.kernels.base import Builder, KernelContext
from compiler_core.loop.ir import INDEX, Binary, Cast, Const, Expr, Select, Unary, maximum, minimum
from compiler_core.te import Tensor, compute, reduce_axis, reduce_sum

F64 = "float64"


def _c(value: float) -> Expr:
    return Const(float(value), F64)


def _sigmoid(x, a, b):
    return _c(0.5) * (_c(1.0) + Unary("tanh", _c(0.5) * x))


ACTIVATIONS: dict[str, Callable[[Expr, float, float], Expr]] = {
    "Relu": lambda x, a, b: maximum(x, _c(0.0)),
    "Tanh": lambda x, a, b: Unary("tanh", x),
    "Sigmoid": _sigmoid,
    "Affine": lambda x, a, b: _c(a) * x + _c(b),
    "LeakyRelu": lambda x, a, b: Select(x >= _c(0.0), x, _c(a) * x),
    "ThresholdedRelu": lambda x, a, b: Select(x >= _c(a), x, _c(0.0)),
    "ScaledTanh": lambda x, a, b: _c(a) * Unary("tanh", _c(b) * x),
    "HardSigmoid": lambda x, a, b: minimum(maximum(_c(a) * x + _c(b), _c(0.0)), _c(1.0)),
    "Elu": lambda x, a, b: Select(
        x >= _c(0.0), x, _c(a) * (Unary("exp", minimum(x, _c(0.0))) - _c(1.0))
    ),
    "Softsign": lambda x, a, b: x / (_c(1.0) + Unary("abs", x)),
    "Softplus": lambda x, a, b: (
        maximum(x, _c(0.0)) + Unary("log", _c(1.0) + Unary("exp", -Unary("abs", x)))
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
        self.x = ctx.tensor(node.inputs[0])
        self.w, self.r = ctx.tensor(node.inputs[1]), ctx.tensor(node.inputs[2])
        self.bias = self.optional(3)
        self.lengths = self.optional(4)
        self.peepholes = self.optional(7) if node.op == "LSTM" else None

    def optional(self, index: int) -> Tensor | None:
        inputs = self.node.inputs
        return self.ctx.tensor(inputs[index]) if len(inputs) > index and inputs[index] else None

    def stage(self, shape, body, dtype=F64) -> Tensor:
        return compute(shape, body, self.ctx.stage_name(self.node), dtype)

    def inline(self, shape, body) -> _Inline:
        """An intermediate the default schedule would inline anyway: built as an expression
        directly, it spares the schedule one stage to inline (and verify) per use."""
        return _Inline(body)

    def kept_stage(self, shape, body) -> Tensor:
        """A stage the default schedule keeps in memory instead of inlining: inlining the
        state chain would copy each step's expression into every read of it (exponential in
        the number of steps for an LSTM's cell state)."""
        tensor = self.stage(shape, body)
        self.ctx.note(tensor.name, materialize=True)
        return tensor

    # --- indexing -----------------------------------------------------------------------------

    def length(self, b) -> Expr:
        if self.lengths is None:
            return Const(self.steps, INDEX)
        return minimum(Cast(INDEX, self.lengths[(b,)]), Const(self.steps, INDEX))

    def time_of(self, step, b, backward: bool) -> Expr:
        """The time index a direction's `step` reads: reverse walks each entry's prefix."""
        step = step if isinstance(step, Expr) else Const(step, INDEX)
        if not backward:
            return step
        n = self.length(b)
        return Select(step < n, n - Const(1, INDEX) - step, step)

    def x_at(self, t, b, k) -> Expr:
        return Cast(F64, self.x[(b, t, k) if self.layout else (t, b, k)])

    def bias_at(self, d, row, recurrent: bool) -> Expr:
        if self.bias is None:
            return _c(0.0)
        offset = self.gates * self.hidden if recurrent else 0
        return Cast(F64, self.bias[(d, row + Const(offset, INDEX))])

    def initial(self, index: int, d) -> Tensor:
        given = self.optional(index)

        def body(b, j):
            if given is None:
                return _c(0.0)
            return Cast(F64, given[(b, d, j) if self.layout else (d, b, j)])

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
                    x = minimum(maximum(x, _c(-clip)), _c(clip))
                return ACTIVATIONS[name](x, alpha, beta)

            return apply

        return [make(*spec) for spec in zip(names, alphas, betas, strict=True)]

    def projection(self, d: int, backward: bool) -> Tensor:
        """x_t W^T + Wb for every step: [steps, batch, gates * hidden]."""
        size = self.w.shape[2]

        def body(s, b, row):
            k = reduce_axis(size, "rk")
            t = self.time_of(s, b, backward)
            return reduce_sum(self.x_at(t, b, k) * Cast(F64, self.w[(Const(d, INDEX), row, k)]), k)

        return self.stage((self.steps, self.batch, self.gates * self.hidden), body)

    def recurrent_product(self, d: int, h: Tensor, first_row: int, rows: int, scale=None):
        """(h [* scale]) R^T over `rows` gate rows starting at `first_row`."""

        def body(b, j):
            m = reduce_axis(self.hidden, "rm")
            value = h[(b, m)] if scale is None else h[(b, m)] * scale[(b, m)]
            row = j + Const(first_row, INDEX)
            return reduce_sum(value * Cast(F64, self.r[(Const(d, INDEX), row, m)]), m)

        return self.stage((self.batch, rows), body)

    def run(self, d: int, backward: bool):
        """(per-step hidden states, final states) of direction d."""
        dd = Const(d, INDEX)
        acts = self.activations(d)
        projected = self.projection(d, backward)
        states = [self.initial(5, dd)] + ([self.initial(6, dd)] if self.node.op == "LSTM" else [])
        hidden_steps = []
        cell = {"RNN": self.rnn_step, "GRU": self.gru_step, "LSTM": self.lstm_step}[self.node.op]
        for s in range(self.steps):
            new = cell(d, s, projected, states, acts)
            states = [
                self.kept_stage(
                    (self.batch, self.hidden),
                    lambda b, j, n=n, o=o, s=s: Select(
                        Const(s, INDEX) < self.length(b), n[(b, j)], o[(b, j)]
                    ),
                )
                for n, o in zip(new, states, strict=True)
            ]
            hidden_steps.append(states[0])
        return hidden_steps, states

    def gate(self, d, s, projected, hh, g, b, j) -> Expr:
        """Pre-activation of gate g: projected + recurrent product + both biases."""
        row = j + Const(g * self.hidden, INDEX)
        value = projected[(Const(s, INDEX), b, row)] + self.bias_at(Const(d, INDEX), row, False)
        return value + hh[(b, row)] + self.bias_at(Const(d, INDEX), row, True)

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
                x_h = projected[(Const(s, INDEX), b, row)] + self.bias_at(dd, row, False)
                return g(x_h + r[(b, j)] * (hh[(b, row)] + self.bias_at(dd, row, True)))

        else:
            reset_product = self.recurrent_product(d, h, 2 * hidden, hidden, scale=r)

            def candidate_at(b, j):
                row = j + Const(2 * hidden, INDEX)
                x_h = projected[(Const(s, INDEX), b, row)] + self.bias_at(dd, row, False)
                return g(x_h + reset_product[(b, j)] + self.bias_at(dd, row, True))

        candidate = self.inline((self.batch, hidden), candidate_at)
        return [
            self.inline(
                (self.batch, hidden),
                lambda b, j: (_c(1.0) - z[(b, j)]) * candidate[(b, j)] + z[(b, j)] * h[(b, j)],
            )
        ]

    def lstm_step(self, d, s, projected, states, acts):
        h, c = states
        f, g, act_h = acts
        hidden = self.hidden
        hh = self.recurrent_product(d, h, 0, 4 * hidden)

        def peephole(k, b, j, cell_value):
            if self.peepholes is None:
                return _c(0.0)
            return (
                Cast(F64, self.peepholes[(Const(d, INDEX), j + Const(k * hidden, INDEX))])
                * cell_value
            )

        def input_gate(b, j):
            return f(self.gate(d, s, projected, hh, 0, b, j) + peephole(0, b, j, c[(b, j)]))

        def new_cell(b, j):
            i = input_gate(b, j)
            if self.node.attr("input_forget", 0):
                forget = _c(1.0) - i
            else:
                forget = f(self.gate(d, s, projected, hh, 2, b, j) + peephole(2, b, j, c[(b, j)]))
            return forget * c[(b, j)] + i * g(self.gate(d, s, projected, hh, 3, b, j))

        cell = self.inline((self.batch, hidden), new_cell)

        def new_hidden(b, j):
            o = f(self.gate(d, s, projected, hh, 1, b, j) + peephole(1, b, j, cell[(b, j)]))
            return o * act_h(cell[(b, j)])

        return [self.inline((self.batch, hidden), new_hidden), cell]


def _select_step(steps: list[Tensor], step: Expr, b, j) -> Expr:
    """steps[step][b, j] for a step index known only at run time."""
    value = steps[-1][(b, j)]
    for k in range(len(steps) - 2, -1, -1):
        value = Select(Binary("eq", step, Const(k, INDEX)), steps[k][(b, j)], value)
    return value


def _recurrent(ctx: KernelContext, node: Node):
    rec = _Recurrence(ctx, node)
    directions = num_directions(node)
    reverse_only = node.attr("direction", "forward") == "reverse"
    runs = [rec.run(d, reverse_only or d == 1) for d in range(directions)]
    out_types = [ctx.type(v) for v in node.outputs if v]
    dtype = out_types[0].dtype
    results = []

    def y_body(*i):
        t, d, b, j = (i[1], i[2], i[0], i[3]) if rec.layout else i
        value = _c(0.0)
        for k, (steps, _) in enumerate(runs):
            backward = reverse_only or k == 1
            step = rec.time_of(t, b, backward)
            inside = t < rec.length(b)
            this = Select(inside, _select_step(steps, step, b, j), _c(0.0))
            value = (
                this if directions == 1 else Select(Binary("eq", d, Const(k, INDEX)), this, value)
            )
        return Cast(dtype, value)

    def final_body(state_index):
        def body(*i):
            d, b, j = (i[1], i[0], i[2]) if rec.layout else i
            value = _c(0.0)
            for k, (_, finals) in enumerate(runs):
                this = finals[state_index][(b, j)]
                value = (
                    this
                    if directions == 1
                    else Select(Binary("eq", d, Const(k, INDEX)), this, value)
                )
            ran = Const(0, INDEX) < rec.length(b)
            return Cast(dtype, Select(ran, value, _c(0.0)))

        return body

    bodies = [y_body, final_body(0), final_body(1)]
    for index, value in enumerate(node.outputs):
        if value:
            results.append(
                compute(ctx.type(value).shape, bodies[index], ctx.stage_name(node), dtype)
            )
    return results


KERNELS: dict[str, Builder] = {op: _recurrent for op in ("RNN", "GRU", "LSTM")}
