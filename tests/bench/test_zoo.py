"""bench.zoo --light: the onnx package's model-zoo graphs, found with their input shapes."""

from __future__ import annotations

from bench.zoo import light_models


def test_the_light_zoo_lists_each_graph_with_its_image_input():
    models = light_models()
    assert {"light_resnet50", "light_shufflenet", "light_densenet121"} <= set(models)
    for path, info in models.values():
        assert path.exists()
        (shape,) = info["inputs"].values()  # initializers listed as inputs are left out
        assert shape == [1, 3, 224, 224]
