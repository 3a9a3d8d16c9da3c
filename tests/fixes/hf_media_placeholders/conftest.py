"""One tiny processor (the seed's placeholder rule as its chat template, `mtp_overlay.bed.steps.media_placeholders`)
per session."""

import pytest

from mtp_overlay.bed.steps import media_placeholders as mp


@pytest.fixture(scope="session")
def processor_folder(tmp_path_factory):
    return mp.write_processor(tmp_path_factory.mktemp("media") / "processor")


@pytest.fixture(scope="session")
def processor(processor_folder):
    return mp.load_processor(processor_folder)
