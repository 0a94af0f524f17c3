"""An ONNX backend (the `onnx.backend.base` module interface) over the Kiln compiler.

`prepare` validates the model; the graph is compiled at the first `run`, when the input
shapes are known. Inputs that decide shapes (a Reshape's shape, Reduce axes, TopK's k, Pad's
pads) cannot be seen by a static-shape compiler at `prepare`: they are bound as constants at
that first run, and the compiled graph is cached by their values.

Two engines: "reference" runs the optimized graph with the numpy reference executor (it tests
import and passes); "native" compiles the graph to a module archive and runs that (it tests the
whole compiler). An operator without a native kernel is reported as not supported.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, namedtupledict

from compiler_core.frontend.onnx import NotConstantError, import_model, load_model
from compiler_core.graph.ir import Graph
from compiler_core.passes.pipeline import optimize
from compiler_core.reference import run_graph

SUPPORTED_DEVICES = ("CPU",)


ENGINES = ("reference", "native")


class KilnRep(BackendRep):
    """A prepared model: compiles per distinct input signature, then runs."""

    def __init__(self, model: onnx.ModelProto, engine: str = "reference"):
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose from {ENGINES}")
        self.model = model
        self.engine = engine
        self._modules: dict[str, Any] = {}
        initializers = {t.name for t in model.graph.initializer}
        self.input_names = [v.name for v in model.graph.input if v.name not in initializers]
        self.output_names = [v.name for v in model.graph.output]
        self._bound: set[str] = set()  # inputs found to decide shapes
        self._cache: dict[str, Graph] = {}

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        feeds = self._feeds(inputs)
        graph = self.compiled_for(feeds)
        graph_feeds = {n: feeds[n] for n in graph.inputs}
        if self.engine == "native":
            outputs = self._native_module(graph).run(graph_feeds)
        else:
            outputs = run_graph(graph, graph_feeds)
        return namedtupledict("Outputs", self.output_names)(
            *[outputs[n] for n in self.output_names]
        )

    def _native_module(self, graph: Graph):
        from compiler_core.codegen.llvm import CodegenError
        from compiler_core.compiler import compile_graph
        from compiler_core.frontend.onnx import UnsupportedError
        from compiler_core.kernels import KernelError
        from compiler_core.runtime import load
        from compiler_core.target import parse_target

        if graph.key not in self._modules:
            try:
                archive = compile_graph(graph, parse_target("llvm"), verify=False)
            except (KernelError, CodegenError) as err:
                raise UnsupportedError(f"no native kernel: {err}") from None
            self._modules[graph.key] = load(archive)
        return self._modules[graph.key]

    def compiled_for(self, feeds: Mapping[str, np.ndarray]) -> Graph:
        graph = self._cache.get(self._signature(feeds))
        if graph is None:
            graph = self._compile(feeds)
            # Compiling may have grown the bound set, so the key is taken afterwards.
            self._cache[self._signature(feeds)] = graph
        return graph

    def _compile(self, feeds: Mapping[str, np.ndarray]) -> Graph:
        while True:
            shapes = {n: a.shape for n, a in feeds.items() if n not in self._bound}
            constants = {n: feeds[n] for n in self._bound}
            try:
                graph = import_model(self.model, shapes=shapes, constants=constants)
            except NotConstantError as err:
                needed = _graph_input_ancestors(self.model, err.value) & set(self.input_names)
                if not needed or needed <= self._bound:
                    raise
                self._bound |= needed
                continue
            return optimize(graph)

    def _feeds(self, inputs: Any) -> dict[str, np.ndarray]:
        if isinstance(inputs, Mapping):
            return {k: np.asarray(v) for k, v in inputs.items()}
        if isinstance(inputs, np.ndarray):
            inputs = [inputs]
        inputs = list(inputs)
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"model takes {len(self.input_names)} inputs {self.input_names}, got {len(inputs)}"
            )
        return {n: np.asarray(a) for n, a in zip(self.input_names, inputs, strict=True)}

    def _signature(self, feeds: Mapping[str, np.ndarray]) -> str:
        h = hashlib.sha256()
        for name in sorted(feeds):
            array = feeds[name]
            h.update(f"{name}:{array.dtype}:{array.shape};".encode())
            if name in self._bound:
                h.update(np.ascontiguousarray(array).tobytes())
        return h.hexdigest()


def _graph_input_ancestors(model: onnx.ModelProto, value: str) -> set[str]:
    producers = {out: node for node in model.graph.node for out in node.output}
    seen, stack = set(), [value]
    while stack:
        name = stack.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        node = producers.get(name)
        if node is not None:
            stack.extend(node.input)
    return seen


class KilnBackend(Backend):
    @classmethod
    def is_compatible(cls, model, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model, device: str = "CPU", engine: str = "reference", **kwargs: Any):
        if not cls.supports_device(device):
            raise ValueError(f"Kiln's ONNX backend runs on {SUPPORTED_DEVICES}, not {device!r}")
        return KilnRep(load_model(model), engine)

    @classmethod
    def run_model(cls, model, inputs: Any, device: str = "CPU", **kwargs: Any):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(
        cls,
        node: onnx.NodeProto,
        inputs: Sequence[np.ndarray],
        device: str = "CPU",
        outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None = None,
        **kwargs: Any,
    ):
        """Run one node: wraps it in a model whose input types come from `inputs`."""
        arrays = [np.asarray(a) for a in inputs]
        graph_inputs = [
            onnx.helper.make_tensor_value_info(
                name, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape
            )
            for name, a in zip(node.input, arrays, strict=False)
            if name
        ]
        declared = graph_inputs[0].type.tensor_type.elem_type if graph_inputs else 1
        graph_outputs = [
            onnx.helper.make_tensor_value_info(n, declared, None) for n in node.output if n
        ]
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        model = onnx.helper.make_model(
            onnx.helper.make_graph([node], "run_node", graph_inputs, graph_outputs),
            opset_imports=[onnx.helper.make_opsetid("", opset)],
        )
        # The checker wants declared output types; ONNX's own inference supplies them (Kiln
        # infers its own types on import regardless).
        model = onnx.shape_inference.infer_shapes(model)
        feeds = {n: a for n, a in zip(node.input, arrays, strict=False) if n}
        return cls.run_model(model, feeds, device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return str(device).upper().split(":")[0] in SUPPORTED_DEVICES


# The module interface of `onnx.backend.base`, as `onnxruntime.backend` exposes it.
prepare = KilnBackend.prepare
run_model = KilnBackend.run_model
run_node = KilnBackend.run_node
supports_device = KilnBackend.supports_device
is_compatible = KilnBackend.is_compatible
