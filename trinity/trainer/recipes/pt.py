"""Pre-training (`pt`): the SFT step on packed plain-text rows (`trinity.data.pretrain`): every token is
trained."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trinity.trainer.recipes.sft import SFTRecipe

if TYPE_CHECKING:
    from trinity.data.pretrain import PTData


class PTRecipe(SFTRecipe):
    def build_data(self) -> PTData:
        from megatron.core import parallel_state as ps

        from trinity.data.pretrain import pt_data_from_job

        # No vocabulary scan here: `trinity run` made it on every node before launching (its plan reads
        # the data, as `trinity validate` does), and on a corpus larger than RAM each rank re-reading
        # every .bin from disk would multiply the start-up time by the number of ranks.
        return pt_data_from_job(
            self.cfg, dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(), check_vocab=False,
        )
