"""Export the bench zoo: architectures the shared models lack, as ONNX files, from PyTorch.

    python bench/zoo_export.py --out build/zoo [--models shufflenet_v2 vit_b_16] [--small]

Runs in an environment with torch, torchvision and transformers (not the project's venv, and
not in CI: `pip install torch torchvision transformers onnx onnxscript` in a venv of its own).
Weights are randomly initialized (no hub download: nothing outside the package registries is
reachable here); speed and correctness do not depend on trained values. `--small` exports
reduced versions of each family (fewer blocks, smaller inputs) for the correctness tests.

Each file is `<out>/<name>.onnx` with a sidecar `<name>.json` giving its input shapes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

OPSET = 17


# --- models that no library ships in the shape we want ----------------------------------------


class UNet(nn.Module):
    """A small U-Net: two down steps (conv-relu x2, max pool), a bottleneck, two up steps
    (ConvTranspose k2 s2, Concat with the skip, conv-relu x2), a 1x1 head."""

    def __init__(self, channels=(24, 48, 96), in_channels=3, classes=2):
        super().__init__()
        c1, c2, c3 = channels

        def block(cin, cout):
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(cout, cout, 3, padding=1),
                nn.ReLU(),
            )

        self.down1, self.down2, self.bottom = block(in_channels, c1), block(c1, c2), block(c2, c3)
        self.pool = nn.MaxPool2d(2)
        self.up2, self.dec2 = nn.ConvTranspose2d(c3, c2, 2, stride=2), block(2 * c2, c2)
        self.up1, self.dec1 = nn.ConvTranspose2d(c2, c1, 2, stride=2), block(2 * c1, c1)
        self.head = nn.Conv2d(c1, classes, 1)

    def forward(self, x):
        s1 = self.down1(x)
        s2 = self.down2(self.pool(s1))
        b = self.bottom(self.pool(s2))
        d2 = self.dec2(torch.cat([self.up2(b), s2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), s1], dim=1))
        return self.head(d1)


class VideoNet(nn.Module):
    """A small 3-D conv video classifier (C3D-style): conv3d-bn-relu stages with pooling."""

    def __init__(self, widths=(32, 64, 128), classes=10):
        super().__init__()
        layers, cin = [], 3
        for k, width in enumerate(widths):
            layers += [
                nn.Conv3d(cin, width, 3, padding=1, bias=False),
                nn.BatchNorm3d(width),
                nn.ReLU(),
                nn.Conv3d(width, width, 3, padding=1, bias=False),
                nn.BatchNorm3d(width),
                nn.ReLU(),
                nn.MaxPool3d((1, 2, 2) if k == 0 else 2),
            ]
            cin = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3, 4)))


# --- the zoo ----------------------------------------------------------------------------------


def _torchvision(name: str, **kwargs) -> Callable[[], nn.Module]:
    def make():
        import torchvision.models as tv

        return getattr(tv, name)(weights=None, **kwargs)

    return make


def _video_r2plus1d() -> nn.Module:
    import torchvision.models.video as tvv

    return tvv.r2plus1d_18(weights=None)


def _wav2vec2(small: bool) -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(
        hidden_size=256 if small else 768,
        num_hidden_layers=2 if small else 12,
        num_attention_heads=4 if small else 12,
        intermediate_size=512 if small else 3072,
        conv_dim=(128,) * 7 if small else (512,) * 7,
        num_conv_pos_embeddings=32 if small else 128,
        num_conv_pos_embedding_groups=8 if small else 16,
        feat_extract_norm="group",
        do_stable_layer_norm=False,
    )

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Wav2Vec2Model(config)

        def forward(self, audio):
            return self.model(audio).last_hidden_state

    return Encoder()


# name: (family, builder(small) -> module, input shape (full), input shape (small))
ZOO: dict[str, tuple[str, Callable[[bool], nn.Module], list[int], list[int]]] = {
    "shufflenet_v2": (
        "channel shuffle, odd channels",
        lambda small: _torchvision("shufflenet_v2_x1_0")(),
        [1, 3, 224, 224],
        [1, 3, 64, 64],
    ),
    "mobilenet_v3": (
        "hard-swish, squeeze-excitation, 5x5 depthwise",
        lambda small: _torchvision("mobilenet_v3_large")(),
        [1, 3, 224, 224],
        [1, 3, 64, 64],
    ),
    "resnext50": (
        "grouped 3x3 convs",
        lambda small: _torchvision("resnext50_32x4d")(),
        [1, 3, 224, 224],
        [1, 3, 64, 64],
    ),
    "convnext_tiny": (
        "7x7 depthwise, LayerNorm, GELU",
        lambda small: _torchvision("convnext_tiny")(),
        [1, 3, 224, 224],
        [1, 3, 64, 64],
    ),
    "vit_b_16": (
        "vision transformer, 197 tokens",
        lambda small: _torchvision("vit_b_16", image_size=224 if not small else 64)(),
        [1, 3, 224, 224],
        [1, 3, 64, 64],
    ),
    "swin_t": (
        "shifted windows, ragged matmuls",
        lambda small: _torchvision("swin_t")(),
        [1, 3, 224, 224],
        [1, 3, 64, 64],
    ),
    "wav2vec2": (
        "Conv1d feature extractor + transformer",
        _wav2vec2,
        [1, 16000],
        [1, 4000],
    ),
    "unet": (
        "ConvTranspose decoder, Concat skips",
        lambda small: UNet((8, 16, 32) if small else (24, 48, 96)),
        [1, 3, 192, 192],
        [1, 3, 32, 32],
    ),
    "r2plus1d_18": (
        "(2+1)-D video convs",
        lambda small: VideoNet((8, 16, 24)) if small else _video_r2plus1d(),
        [1, 3, 8, 112, 112],
        [1, 3, 4, 16, 16],
    ),
}


def export(name: str, out: Path, small: bool) -> Path:
    family, build, full_shape, small_shape = ZOO[name]
    torch.manual_seed(0)
    module = build(small).eval()
    shape = small_shape if small else full_shape
    example = torch.randn(*shape)
    path = out / f"{name}.onnx"
    with torch.no_grad():
        torch.onnx.export(
            module,
            (example,),
            str(path),
            input_names=["x"],
            output_names=["y"],
            opset_version=OPSET,
            dynamo=False,
        )
    (out / f"{name}.json").write_text(
        json.dumps({"family": family, "inputs": {"x": shape}, "small": small})
    )
    return path


def main() -> None:
    # nn.MultiheadAttention's inference fast path is a fused op the ONNX exporter cannot write.
    torch.backends.mha.set_fastpath_enabled(False)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/zoo"))
    parser.add_argument("--models", nargs="*", default=list(ZOO))
    parser.add_argument("--small", action="store_true", help="reduced versions, for tests")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        path = export(name, args.out, args.small)
        print(f"{name:14s} {path} ({path.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
