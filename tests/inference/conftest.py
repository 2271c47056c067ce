from tests.training.conftest import tiny_data  # noqa: F401 (the session's tiny data_prep output)
