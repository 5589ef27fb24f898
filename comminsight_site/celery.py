"""The Celery application. Broker and result backend come from settings (Redis, or in-process when unset)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "comminsight_site.settings")

app = Celery("comminsight")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
