"""One process of the compile-cache test (tests/trainer/test_compile_cache.py): a tiny decoder
layer compiled by trainer/compiled.py with inductor, run on two lengths; prints inductor's
cache counters and the graphs compiled as one JSON line."""

import json

import torch
from torch._dynamo.utils import counters

from handoff.trainer.compiled import compiles_so_far, set_compiled_layers


class TinyLayer(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.norm = torch.nn.RMSNorm(width)
        self.up = torch.nn.Linear(width, width)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return x_BTD + torch.nn.functional.silu(self.up(self.norm(x_BTD)))


class TinyModel(torch.nn.Module):
    """The attribute path set_compiled_layers walks: model.model.layers."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([TinyLayer(), TinyLayer()])


if __name__ == "__main__":
    torch.manual_seed(0)
    model = TinyModel()
    set_compiled_layers(model, True)
    with torch.no_grad():
        for tokens in (5, 9):
            x = torch.randn(1, tokens, 8)
            for layer in model.model.layers:
                x = layer(x)
    print(json.dumps({"compiles": compiles_so_far(),
                      "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
                      "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
                      "aot_hit": counters["aot_autograd"]["autograd_cache_hit"]}))
