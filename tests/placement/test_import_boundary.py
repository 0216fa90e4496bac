"""The layout math works where Ray is not installed: importing tandem.placement imports neither ray nor torch."""

from __future__ import annotations

import subprocess
import sys

# Run in a fresh interpreter with `ray` and `torch` made unimportable: any import of
# them (at package import, or in the Ray-free paths) fails loudly instead of passing.
CHECK = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "torch"):
            raise ImportError("blocked in this test: " + name)
        return None

sys.meta_path.insert(0, Block())

import tandem.placement as p

spec = p.PlacementSpec(actor_num_gpus_per_node=2, rollout_num_gpus=2, use_critic=True)
layout = p.compute_layout(spec)
empty = p.create_placement_groups(p.PlacementSpec(rollout_external=True, debug_rollout_only=True))
assert empty.pg is None and not empty.actor and not empty.rollout, empty
empty.remove()
print(layout.num_gpus, layout.rollout_offset, sorted(m for m in ("ray", "torch") if m in sys.modules))
"""


def test_layout_and_empty_placements_need_neither_ray_nor_torch() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4", "2", "[]"]
