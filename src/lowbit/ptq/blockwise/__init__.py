"""The block-wise engine every block-by-block pass runs on: SignRound (V1/V2), GPTQ and AWQ's scale search.

One module per job: ``access`` (a block's planned layers, swapping in QuantLinears),
``cache`` (activation caches and pushing them through a block), ``capture`` (block 0's
inputs), ``shards`` (torch.distributed), ``store`` (the work folder that resumes a run),
``offload`` (where each block's float weights come from), ``options`` (the tuning walk's
own knobs and the cache placement), ``loop`` (the one walk over the blocks, and the
`BlockPass` a pass plugs into it) and ``tune`` (the tuning methods' pass, and the
`BlockTuner` door a method comes in by). The run's shared settings reach the walk as
one `lowbit.ptq.methods.RunContext`.
"""

from lowbit.ptq.blockwise.access import module_names, run_block
from lowbit.ptq.blockwise.cache import CACHE_DEVICES, CACHE_DTYPES, map_block, new_cache
from lowbit.ptq.blockwise.capture import capture_inputs
from lowbit.ptq.blockwise.loop import BlockPass, Walk, walk_blocks
from lowbit.ptq.blockwise.options import PipelineOptions
from lowbit.ptq.blockwise.shards import Shard, check_world, current_shard, reduce_across, reduce_tensor
from lowbit.ptq.blockwise.store import WorkDir, check_work_folder, fingerprint, work_settings
from lowbit.ptq.blockwise.tune import BlockJob, BlockTuner, quantize_blockwise

__all__ = ["CACHE_DEVICES", "CACHE_DTYPES", "BlockJob", "BlockPass", "BlockTuner", "PipelineOptions", "Shard",
           "Walk", "WorkDir", "capture_inputs", "check_work_folder", "check_world", "current_shard", "fingerprint",
           "map_block", "module_names", "new_cache", "quantize_blockwise", "reduce_across", "reduce_tensor",
           "run_block", "walk_blocks", "work_settings"]
