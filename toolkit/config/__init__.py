"""Run configuration: typed dataclass sections filled from defaults < `--config run.yaml` < flags, with
what a launcher or a `--deepspeed` file fixes, validated once. This face re-exports the names the
rest of the code imports from `toolkit.config`; they live in:

- `schema`: the sections, `Config`, `DataSettings`, `SECTIONS`, the defaults, every key's section and type;
- `parse`: flags and YAML into a `Config` (`parse_config`), value coercion, other tools' names, `save_config`;
- `checks`: the checks of a resolved `Config` (`validate`, `padding_free_blocked`);
- `columns`, `paths`, `output_dir`: `--columns`, what a run reads, and the output folder, checked;
- `datasets`, `objectives`, `foreign`, `chat_template`, `hub`, `trackers`: one setting's spec each.
"""

from __future__ import annotations

from toolkit.config.parse import build_parser, closest_key, load_yaml, parse_config, save_config  # noqa: F401
from toolkit.config.schema import (DEFAULT_DATASET, DEFAULT_MODEL, SECTIONS, Config, DataConfig,  # noqa: F401
                                   DataSettings, ModelConfig, OutputConfig, PlanConfig, RLConfig, TrainConfig,
                                   _fields)
from toolkit.config.checks import padding_free_blocked, validate  # noqa: F401
