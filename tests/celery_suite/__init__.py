"""What runs Celery's own integration tests with delayq (``tests/test_celery_suite.py``)."""
