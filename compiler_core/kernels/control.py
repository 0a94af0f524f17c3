"""The native kernel of Loop (ONNX Scan and Loop; compiler_core/graph/ops/control.py).

One `te.recurrence` over the steps: inside a step, the body's nodes are built by their own
kernel builders, reading the previous states, the step's slices of the scanned inputs and
the iteration number; the states' new values are the body's state outputs, and every scan
output is a state too (row t is the slice step t produced). Body stages that read nothing of
the step (a captured weight's transform, say) land before the loop, computed once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from compiler_core.graph.ir import Graph, Node
from compiler_core.graph.ops.control import body_of, scan_output_types
from compiler_core.kernels.base import Builder, KernelContext, KernelError
from compiler_core.loop.ir import INDEX, Binary, Cast, Const, Expr, Select
from compiler_core.te import Tensor, compute, recurrence
from compiler_core.te.tensor import NestedRecurrenceError


class BodyContext(KernelContext):
    """What a body node's builder sees inside a step: the body's values (bound to the step's
    stages, or computed by earlier body nodes), the body's constants as build-time inputs,
    and, for the outer values the body captures, the loop kernel's own inputs. Stage names,
    notes and kernel inputs go to the loop kernel's context."""

    def __init__(
        self,
        outer: KernelContext,
        body: Graph,
        bound: Mapping[str, Tensor],
        captured: Mapping[str, str],
        loop: Node,
        label: str,
    ):
        self.outer = outer
        self.graph = body
        self.target, self.prefix = outer.target, outer.prefix
        self.inputs, self.packed_arrays = outer.inputs, outer.packed_arrays
        self.stage_ops, self.notes = outer.stage_ops, outer.notes
        self.choices = {}  # the tuner's choices are the loop kernel's, not its body nodes'
        self.tensors = dict(bound)
        self.captured = dict(captured)  # body input -> the outer value the loop passes in
        self.loop = loop
        self.label = label  # keeps this body's packed constants apart from other loops'

    def stage_name(self, node: Node, prefix: str = "") -> str:
        return self.outer.stage_name(node, prefix)

    def is_constant(self, value: str) -> bool:
        if value in self.graph.constants:
            return True
        outer = self.captured.get(value)
        return outer is not None and self.outer.is_constant(outer)

    def constant(self, value: str) -> np.ndarray:
        if value in self.graph.constants:
            return np.asarray(self.graph.constants[value])
        return self.outer.constant(self.captured[value])

    def tensor(self, value: str) -> Tensor:
        if value not in self.tensors:
            if value in self.graph.constants:
                array = self.graph.constants[value]
                self.tensors[value] = self.outer.packed(f"{self.label}.{value}", "body", array)
            elif value in self.captured:
                self.tensors[value] = self.outer.tensor(self.captured[value])
            else:
                raise KernelError(f"loop body {self.graph.name!r}: value {value!r} is unbound")
        return self.tensors[value]

    def packed(self, source: str, label: str, array: np.ndarray) -> Tensor:
        return self.outer.packed(f"{self.label}.{source}", label, array)

    def view(self, value: str, dtype: str, shape: Sequence[int]) -> Tensor:
        if value in self.captured:
            return self.outer.view(self.captured[value], dtype, shape)
        raise KernelError(
            f"loop body {self.graph.name!r}: reinterpreting {value!r}'s bytes inside a step "
            "is not supported"
        )

    def reshaped(self, value: str, shape: Sequence[int]) -> Tensor:
        if value in self.captured:
            return self.outer.reshaped(self.captured[value], shape)
        source = self.tensor(value)
        return compute(tuple(shape), _reshape_body(source, shape), self.stage_name(self.loop))


def _reshape_body(source: Tensor, shape: Sequence[int]):
    """Read `source` (row-major) in another shape of the same size."""

    def body(*index):
        flat: Expr = Const(0, INDEX)
        for i, extent in zip(index, shape, strict=True):
            flat = flat * Const(extent, INDEX) + i
        unravelled = []
        for extent in reversed(source.shape):
            unravelled.append(Binary("mod", flat, Const(extent, INDEX)))
            flat = Binary("floordiv", flat, Const(extent, INDEX))
        return source[tuple(reversed(unravelled))]

    return body


def _insert(index: Sequence[Expr], axis: int, value: Expr) -> tuple[Expr, ...]:
    return (*index[:axis], value, *index[axis:])


class _Loop:
    def __init__(self, ctx: KernelContext, node: Node):
        self.ctx, self.node = ctx, node
        self.body = body_of(node)
        self.steps = node.attr("steps")
        self.states = node.attr("num_states")
        self.scanned = node.attr("num_scan_inputs")
        self.iteration = node.attr("iteration_input")
        self.label = ctx.stage_name(node)
        first_captured = self.iteration + self.states + self.scanned
        outer_captured = node.inputs[self.states + self.scanned :]
        self.captured = dict(zip(self.body.inputs[first_captured:], outer_captured, strict=True))

    def name(self) -> str:
        return self.ctx.stage_name(self.node)

    def time(self, t, backward: int) -> Expr:
        return Const(self.steps - 1, INDEX) - t if backward else t

    def step_inputs(self, t, previous) -> dict[str, Tensor]:
        """The body's inputs at step t: iteration number, previous states, scanned slices."""
        names = list(self.body.inputs)
        bound: dict[str, Tensor] = {}
        if self.iteration:
            number = compute((), lambda: Cast("int64", t), self.name())
            bound[names.pop(0)] = number
        for k in range(self.states):
            # A copy per step: a state read many times (a product's operand) is read from
            # memory, not through the first-step test of `previous` at every read.
            copy = compute(
                self.body.types[names[k]].shape, lambda *i, p=previous[k]: p[i], self.name()
            )
            self.ctx.note(copy.name, materialize=True)
            bound[names[k]] = copy
        axes = self.node.attr("scan_input_axes")
        directions = self.node.attr("scan_input_directions")
        for j in range(self.scanned):
            x = self.ctx.tensor(self.node.inputs[self.states + j])
            axis, row = axes[j], self.time(t, directions[j])
            name = names[self.states + j]
            bound[name] = compute(
                self.body.types[name].shape,
                lambda *i, x=x, axis=axis, row=row: x[_insert(i, axis, row)],
                self.name(),
            )
        return bound

    def run_body(self, t, previous) -> list[Tensor]:
        # The registry imports this module: looked up when a kernel is built.
        from compiler_core.kernels import KERNELS

        bound = self.step_inputs(t, previous)
        sub = BodyContext(self.ctx, self.body, bound, self.captured, self.node, self.label)
        for node in self.body.nodes:
            builder = KERNELS.get(node.op)
            if builder is None:
                raise KernelError(f"node {node.name!r}: no CPU kernel for operator {node.op}")
            produced = [v for v in node.outputs if v]
            for value, tensor in zip(produced, builder(sub, node), strict=True):
                sub.tensors[value] = tensor
        return [sub.tensor(v) for v in self.body.outputs]

    def build(self) -> list[Tensor]:
        inputs = [self.ctx.tensor(v) for v in self.node.inputs[: self.states]]
        scan_types = scan_output_types(self.node)
        zeros = [  # scan outputs are states whose previous value no step reads
            compute(t.shape[:a] + t.shape[a + 1 :], lambda *i, d=t.dtype: Const(0, d), self.name())
            for t, a in zip(scan_types, self.node.attr("scan_output_axes"), strict=True)
        ]
        guarded = self.node.attr("guarded")

        def step(t, previous):
            outs = self.run_body(t, previous)
            updates = []
            for k, out in enumerate(outs):
                if guarded and k < self.states:  # a step after the condition fell changes nothing
                    updates.append(
                        lambda *i, o=out, p=previous[k]: Select(previous[0][()], o[i], p[i])
                    )
                else:
                    updates.append(lambda *i, o=out: o[i])
            return updates

        try:
            rows = recurrence(self.steps, inputs + zeros, step, self.label)
        except NestedRecurrenceError as err:
            raise KernelError(f"node {self.node.name!r}: {err}") from None
        return self.outputs(rows, scan_types)

    def outputs(self, rows: list[Tensor], scan_types) -> list[Tensor]:
        last = Const(self.steps - 1, INDEX)
        results = []
        for k, value in enumerate(self.node.outputs[: self.states]):
            if value:
                state = rows[k]
                results.append(
                    compute(state.shape[1:], lambda *i, s=state: s[(last, *i)], self.name())
                )
        axes = self.node.attr("scan_output_axes")
        directions = self.node.attr("scan_output_directions")
        for j, value in enumerate(self.node.outputs[self.states :]):
            if value:
                state, axis, backward = rows[self.states + j], axes[j], directions[j]

                def body(*i, s=state, axis=axis, backward=backward):
                    row = self.time(i[axis], backward)
                    return s[(row, *i[:axis], *i[axis + 1 :])]

                results.append(compute(scan_types[j].shape, body, self.name()))
        return results


def _loop(ctx: KernelContext, node: Node) -> list[Tensor]:
    return _Loop(ctx, node).build()


KERNELS: dict[str, Builder] = {"Loop": _loop}
