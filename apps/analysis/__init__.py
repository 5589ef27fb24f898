"""Analysis jobs (Celery), results, live progress (Channels), reports and trace export."""
