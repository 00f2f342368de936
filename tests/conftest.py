"""Suite-wide settings: one intra-op thread (on a busy 2-core machine torch's thread pool makes the
many small index operations here thousands of times slower), and tests/ importable by name."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
