"""The one settings module of the site. Everything that differs between machines comes from the environment.

Embedded default (no ``DATABASE_URL``, no ``REDIS_URL``): SQLite in the data directory, Celery tasks run
in-process, in-memory channel layer — ``make run`` works on a bare machine. With ``DATABASE_URL`` and
``REDIS_URL`` set, PostgreSQL (psycopg 3), a Redis broker and the channels-redis layer are used.
``COMMINSIGHT_ENV=production`` makes ``SECRET_KEY`` and ``ALLOWED_HOSTS`` (or ``COMMINSIGHT_SERVER_PUBLIC_URL``)
mandatory and turns on the HTTPS-only settings that ``manage.py check --deploy`` asks for.
See docs/operators.md for every variable.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

ENVIRONMENT = env.str("COMMINSIGHT_ENV", default="development")
if ENVIRONMENT not in {"development", "production"}:
    raise ImproperlyConfigured(f"COMMINSIGHT_ENV must be 'development' or 'production', not {ENVIRONMENT!r}")
PRODUCTION = ENVIRONMENT == "production"

DATA_DIR = Path(env.str("COMMINSIGHT_SERVER_DATA_DIR", default=str(BASE_DIR / ".data"))).resolve()
# Stored archives, the Parquet operations store and analysis artefacts (comminsight_site/objectstore.py):
# empty = DATA_DIR, or s3://bucket/prefix with the standard AWS_* variables.
STORAGE_URL = env.str("COMMINSIGHT_STORAGE_URL", default="")
if STORAGE_URL and (urlsplit(STORAGE_URL).scheme != "s3" or not urlsplit(STORAGE_URL).netloc):
    raise ImproperlyConfigured(f"COMMINSIGHT_STORAGE_URL must be empty or s3://bucket/prefix, not {STORAGE_URL!r}")
STORAGE_S3 = {
    "endpoint_url": env.str("AWS_ENDPOINT_URL", default=""),
    "region": env.str("AWS_REGION", default=env.str("AWS_DEFAULT_REGION", default="us-east-1")),
    "access_key": env.str("AWS_ACCESS_KEY_ID", default=""),
    "secret_key": env.str("AWS_SECRET_ACCESS_KEY", default=""),
}
SERVER_LISTEN = env.str("COMMINSIGHT_SERVER_LISTEN", default="127.0.0.1:8000")
# When set, the machine API (/api/v1/ingest/) is served only on this second listener (see docs/operators.md).
SERVER_AGENT_LISTEN = env.str("COMMINSIGHT_SERVER_AGENT_LISTEN", default="")
PUBLIC_URL = env.str("COMMINSIGHT_SERVER_PUBLIC_URL", default="").rstrip("/")
# Request bodies streamed to the application as they arrive, upload chunks written to disk ahead of Django
# (comminsight_site.uvicorn_serving or daphne_streaming, apps.workloads.api.stream); off = stock Daphne, which
# buffers each body.
SERVER_STREAM_BODIES = env.bool("COMMINSIGHT_SERVER_STREAM_BODIES", default=True)
# The HTTP and WebSocket server of `manage.py serve`: uvicorn (comminsight_site.uvicorn_serving) or daphne
# (comminsight_site.daphne_streaming). With streaming off it is always stock Daphne.
SERVER_HTTP = env.str("COMMINSIGHT_SERVER_HTTP", default="uvicorn")
if SERVER_HTTP not in ("uvicorn", "daphne"):
    raise ImproperlyConfigured(f"COMMINSIGHT_SERVER_HTTP must be uvicorn or daphne, not {SERVER_HTTP!r}")
# With streaming: a request whose body stops arriving for this long answers 408 and its connection is closed.
SERVER_BODY_TIMEOUT_S = env.float("COMMINSIGHT_SERVER_BODY_TIMEOUT_S", default=30.0)
# uvicorn: one access line per request (the ``uvicorn.access`` logger, at INFO). Off saves formatting and writing it
# (docs/operators.md, "Performance (agent ingest)"); errors and warnings are logged either way.
SERVER_ACCESS_LOG = env.bool("COMMINSIGHT_SERVER_ACCESS_LOG", default=True)

if PRODUCTION:
    # A missing production secret must fail at start, loudly (environ raises ImproperlyConfigured).
    SECRET_KEY = env.str("SECRET_KEY")
    DEBUG = env.bool("DEBUG", default=False)
else:
    SECRET_KEY = env.str("SECRET_KEY", default="django-insecure-development-only-never-use-in-production")
    # Django's debug pages list every URL pattern and settings: on only when development is asked for
    # explicitly (COMMINSIGHT_ENV=development), never for a plain `make run` that others may reach.
    DEBUG = env.bool("DEBUG", default="COMMINSIGHT_ENV" in os.environ)

_public_host = urlsplit(PUBLIC_URL).hostname if PUBLIC_URL else None
_default_hosts = [_public_host] if _public_host else ([] if PRODUCTION else ["127.0.0.1", "localhost", "[::1]"])
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=_default_hosts)
if PRODUCTION and not ALLOWED_HOSTS:
    raise ImproperlyConfigured("production needs ALLOWED_HOSTS or COMMINSIGHT_SERVER_PUBLIC_URL")
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[PUBLIC_URL] if PUBLIC_URL else [])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "axes",
    "apps.accounts",
    "apps.workloads",
    "apps.analysis",
    "apps.monitoring",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "comminsight_site.views.UnknownMethodMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "apps.accounts.middleware.AgentListenerMiddleware",
    # Axes last: it turns a lockout signalled by its backend into a response.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "comminsight_site.urls"
ASGI_APPLICATION = "comminsight_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "apps.accounts.context_processors.site",
            ],
        },
    },
]

# --- Real parts or embedded defaults -------------------------------------------------------------------------
DATABASES = {"default": env.db_url("DATABASE_URL", default=f"sqlite:///{DATA_DIR / 'db.sqlite3'}")}
# Several test runs may share one PostgreSQL server: give each its own throw-away test database.
DATABASES["default"]["TEST"] = {"NAME": env.str("COMMINSIGHT_TEST_DB_NAME", default=f"test_comminsight_{os.getpid()}")}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    DATABASES["default"]["TEST"] = {}
    # Embedded mode: wait for a concurrent writer instead of failing at once. Daphne's threads and the in-process
    # tasks write at the same time (the demo's agent uploads while ingest runs): a transaction that read first
    # and writes later cannot wait for the lock (SQLite answers "database is locked" at once), so every
    # transaction takes the write lock when it begins; WAL lets pages read meanwhile.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        timeout=20, transaction_mode="IMMEDIATE", init_command="PRAGMA journal_mode=WAL;"
    )
DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=0)
# PostgreSQL: a connection pool per process. Under ASGI each request's sync code runs in a thread of its own, so
# CONN_MAX_AGE cannot keep connections; without a pool every request pays for a new server backend (~10 ms).
if (
    DATABASES["default"]["ENGINE"].endswith("postgresql")
    and DATABASES["default"]["CONN_MAX_AGE"] == 0
    and env.bool("COMMINSIGHT_DB_POOL", default=True)
):
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": env.int("COMMINSIGHT_DB_POOL_MAX", default=20),
        "timeout": 30,
    }
# PostgreSQL: the agents' frequent statements (comminsight_site.rows.cursor: parameters bound by the server) are
# prepared on a connection once they ran this many times on it; 0 or less: never (a pooler in transaction mode
# cannot keep prepared statements unless it tracks them: PgBouncer only from 1.21 and only with
# max_prepared_statements set). Django's own queries bind on the client and are never prepared either way.
if DATABASES["default"]["ENGINE"].endswith("postgresql"):
    prepare_threshold = env.int("COMMINSIGHT_DB_PREPARE_THRESHOLD", default=5)
    DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = (
        prepare_threshold if prepare_threshold > 0 else None
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env.str("REDIS_URL", default="")
if REDIS_URL:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = REDIS_URL or None
# Without Redis there is no worker to send to: run tasks in the calling process.
CELERY_TASK_ALWAYS_EAGER = not REDIS_URL
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = env.str("CELERY_QUEUE", default="comminsight")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# With acks_late, a task whose worker died is redelivered after this many seconds (Redis transport):
# longer than the longest task, so a slow ingest is not run twice needlessly (a duplicate would be harmless).
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env.int("COMMINSIGHT_INGEST_TASK_TIME_LIMIT_S", default=1800) + 600
}
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULE: dict[str, dict] = {}  # filled below, once the intervals are read

# --- Accounts and security -----------------------------------------------------------------------------------
AUTH_USER_MODEL = "accounts.User"
LOGIN_URL = "accounts:login"
LOGIN_REDIRECT_URL = "workloads:list"
LOGOUT_REDIRECT_URL = "accounts:login"
PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.Argon2PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
]
AUTH_PASSWORD_VALIDATORS = [{"NAME": "apps.accounts.passwords.ByteLengthValidator"}]
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
    "apps.accounts.oidc.ExternalIdentityBackend",  # does nothing unless single sign-on is configured
]
# Single sign-on (OpenID Connect, apps/accounts/oidc.py): on when a client id is set; the provider's endpoints
# and the client secret are then required (a missing one fails at start). docs/operators.md lists them.
OIDC_RP_CLIENT_ID = env.str("COMMINSIGHT_OIDC_CLIENT_ID", default="")
SSO_ENABLED = bool(OIDC_RP_CLIENT_ID)


def _oidc(name: str) -> str:
    return env.str(name) if SSO_ENABLED else env.str(name, default="")


OIDC_RP_CLIENT_SECRET = _oidc("COMMINSIGHT_OIDC_CLIENT_SECRET")
OIDC_OP_AUTHORIZATION_ENDPOINT = _oidc("COMMINSIGHT_OIDC_AUTHORIZATION_ENDPOINT")
OIDC_OP_TOKEN_ENDPOINT = _oidc("COMMINSIGHT_OIDC_TOKEN_ENDPOINT")
OIDC_OP_USER_ENDPOINT = _oidc("COMMINSIGHT_OIDC_USERINFO_ENDPOINT")
OIDC_OP_JWKS_ENDPOINT = _oidc("COMMINSIGHT_OIDC_JWKS_ENDPOINT")
OIDC_RP_SIGN_ALGO = env.str("COMMINSIGHT_OIDC_SIGN_ALGO", default="RS256")
SSO_PROVIDER_NAME = env.str("COMMINSIGHT_OIDC_PROVIDER_NAME", default="single sign-on")
OIDC_RP_SCOPES = "openid email profile"
OIDC_USE_PKCE = True
OIDC_TIMEOUT = 15
OIDC_AUTHENTICATION_CALLBACK_URL = "accounts:sso_callback"
LOGIN_REDIRECT_URL_FAILURE = "/accounts/login/?sso=failed"
AXES_FAILURE_LIMIT = env.int("AXES_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = env.float("AXES_COOLOFF_HOURS", default=0.25)  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "accounts/locked_out.html"
AXES_ENABLED = env.bool("AXES_ENABLED", default=True)
# Failed sign-ins from one address across every user name (password spraying) before the page answers 429
# for the rest of the cool-off; higher than the per-name limit, so one user's typos do not lock an office NAT.
SIGN_IN_ADDRESS_FAILURE_LIMIT = env.int("AXES_ADDRESS_FAILURE_LIMIT", default=20)

BOOTSTRAP_TOKEN_PATH = DATA_DIR / "bootstrap-token"
# Wrong bootstrap tokens per client address per window before the page answers 429.
BOOTSTRAP_FAILURE_LIMIT = env.int("COMMINSIGHT_BOOTSTRAP_FAILURE_LIMIT", default=5)
BOOTSTRAP_FAILURE_WINDOW_S = 900

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
# "Open in Perfetto" talks to a window it opened through postMessage: same-origin would cut that link.
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin-allow-popups"
if PRODUCTION:
    SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=True)
    # Behind a TLS-terminating proxy that sets X-Forwarded-Proto (see docs/operators.md).
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=True)
    SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=True)

# --- API ------------------------------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.SessionAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": [
        "comminsight_site.permissions.MethodAllowed",
        "rest_framework.permissions.IsAuthenticated",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # The API takes JSON bodies only (views that take other media types say so), parsed with a size and depth
    # limit (400 with a reason, never a RecursionError) into strict fields (comminsight_site.fields).
    "DEFAULT_PARSER_CLASSES": ["comminsight_site.parsers.BoundedJSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"]
    + (["rest_framework.renderers.BrowsableAPIRenderer"] if DEBUG else []),
    "DEFAULT_THROTTLE_RATES": {"ingest": env.str("COMMINSIGHT_INGEST_RATE", default="6000/min")},
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "CommInsight API",
    "DESCRIPTION": "Workloads, sharing, agent tokens and the agents' ingest API.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Swagger UI's assets come from the drf-spectacular-sidecar package, not a CDN (sites often run offline).
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Every operation documents the error answers it can give (400/401/403/404).
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "comminsight_site.openapi.document_errors",
    ],
}

# --- Static files (the Vite build in frontend/dist is one of the sources) ----------------------------------
STATIC_URL = "/static/"
# Development serves through the finders (no collection needed); production collects into the data dir.
_static_root = env.str("STATIC_ROOT", default=str(DATA_DIR / "static") if PRODUCTION else "")
STATIC_ROOT = Path(_static_root) if _static_root else None
FRONTEND_DIST = BASE_DIR / "frontend" / "dist"
# Only list the build when it exists: a missing directory is a system-check warning.
STATICFILES_DIRS = [FRONTEND_DIST] if FRONTEND_DIST.is_dir() else []
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if PRODUCTION
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}
WHITENOISE_USE_FINDERS = not PRODUCTION

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    "loggers": {"axes": {"level": "WARNING"}},
}

# --- Ingest (issue 7) ------------------------------------------------------------------------------------------
INGEST_MAX_CHUNK_BYTES = env.int("COMMINSIGHT_INGEST_MAX_CHUNK_BYTES", default=8 * 1024 * 1024)
INGEST_MAX_ARCHIVE_BYTES = env.int("COMMINSIGHT_INGEST_MAX_ARCHIVE_BYTES", default=2 * 1024**3)
INGEST_MAX_ONESHOT_BYTES = env.int("COMMINSIGHT_INGEST_MAX_ONESHOT_BYTES", default=32 * 1024 * 1024)
INGEST_TOKEN_MAX_BYTES = env.int("COMMINSIGHT_INGEST_TOKEN_MAX_BYTES", default=200 * 1024**3)
INGEST_OWNER_QUOTA_BYTES = env.int("COMMINSIGHT_INGEST_OWNER_QUOTA_BYTES", default=500 * 1024**3)
INGEST_ARCHIVE_MAX_MEMBERS = env.int("COMMINSIGHT_INGEST_ARCHIVE_MAX_MEMBERS", default=10_000)
INGEST_ARCHIVE_MAX_MEMBER_BYTES = env.int("COMMINSIGHT_INGEST_ARCHIVE_MAX_MEMBER_BYTES", default=1024**3)
INGEST_ARCHIVE_MAX_TOTAL_BYTES = env.int("COMMINSIGHT_INGEST_ARCHIVE_MAX_TOTAL_BYTES", default=8 * 1024**3)
INGEST_ARCHIVE_MAX_RATIO = env.float("COMMINSIGHT_INGEST_ARCHIVE_MAX_RATIO", default=200.0)
INGEST_TASK_TIME_LIMIT_S = env.int("COMMINSIGHT_INGEST_TASK_TIME_LIMIT_S", default=1800)
# Ingest attempts per archive before it is quarantined, whatever ended them (apps.workloads.ingest).
INGEST_MAX_ATTEMPTS = env.int("COMMINSIGHT_INGEST_MAX_ATTEMPTS", default=5)
INGEST_RETRY_DELAY_S = env.float("COMMINSIGHT_INGEST_RETRY_DELAY_S", default=30.0)  # doubled per failed attempt
# An attempt holds its archive by a lease renewed every third of this; a killed worker's lease runs out and
# the requeue (every half lease) hands the archive to a live worker: ingested within ~1.5 leases.
INGEST_LEASE_S = env.float("COMMINSIGHT_INGEST_LEASE_S", default=45.0)
INGEST_LIVE_MAX_BYTES = env.int("COMMINSIGHT_INGEST_LIVE_MAX_BYTES", default=1024 * 1024)
# How long a server process reuses an agent token's row (and its owner's) read from the database; a revocation or
# an owner's deactivation made by another process is honoured within this many seconds, one made by the same
# process at once (apps.accounts.services.agent_token_authenticate). 0: read on every request.
AGENT_TOKEN_CACHE_S = env.float("COMMINSIGHT_AGENT_TOKEN_CACHE_S", default=2.0)
DISCOVERY_INTERVAL_S = env.float("COMMINSIGHT_DISCOVERY_INTERVAL_S", default=30.0)
# Where discovery looks while System Settings names no archive path: the agent's default mount (its home,
# /opt/comminsight, or $COMMINSIGHT_HOME), so an agent and the site on one machine meet on defaults in
# <path>/comminsight/02_archives with no configuration.
DEFAULT_ARCHIVE_PATH = env.str(
    "COMMINSIGHT_SERVER_ARCHIVE_PATH", default=env.str("COMMINSIGHT_HOME", default="/opt/comminsight")
)
# The demo job's timing (apps/workloads/demo.py DemoPlan fields as JSON): tests shorten it for a served site.
DEMO_PLAN = env.json("COMMINSIGHT_DEMO_PLAN", default={})
WORKLOAD_LOST_AFTER_S = env.int("COMMINSIGHT_WORKLOAD_LOST_AFTER_S", default=300)
# Heartbeats answered ahead of Django tell open pages at most once per this many seconds per workload (and the
# list pages once for all), the latest state at the end of the interval; a status change at once (live.py).
LIVE_PUBLISH_INTERVAL_S = env.float("COMMINSIGHT_LIVE_PUBLISH_INTERVAL_S", default=1.0)
DATA_UPLOAD_MAX_MEMORY_SIZE = 2_621_440
# Every JSON input (API bodies, archive members) is parsed with these limits (comminsight.formats.boundedjson).
API_JSON_MAX_BYTES = max(DATA_UPLOAD_MAX_MEMORY_SIZE, INGEST_LIVE_MAX_BYTES)
API_JSON_MAX_DEPTH = env.int("COMMINSIGHT_JSON_MAX_DEPTH", default=32)
FILE_UPLOAD_MAX_MEMORY_SIZE = 2_621_440

# --- Analysis jobs (apps/analysis) ----------------------------------------------------------------------------
ANALYSIS_TASK_TIME_LIMIT_S = env.int("COMMINSIGHT_ANALYSIS_TASK_TIME_LIMIT_S", default=1800)
# Rows per partition of a partitioned analysis (hang, perf): bounds one map task's memory (docs/operators.md).
ANALYSIS_PARTITION_ROWS = env.int("COMMINSIGHT_ANALYSIS_PARTITION_ROWS", default=4_000_000)

# --- Monitoring time series (apps/monitoring) -----------------------------------------------------------------
# Points and rollups older than this are purged by the periodic task (hourly).
MONITORING_RETENTION_DAYS = env.float("COMMINSIGHT_MONITORING_RETENTION_DAYS", default=30.0)
if MONITORING_RETENTION_DAYS <= 0:
    raise ImproperlyConfigured("COMMINSIGHT_MONITORING_RETENTION_DAYS must be a positive number of days")

CELERY_BEAT_SCHEDULE.update(
    {
        "discover-archives": {"task": "apps.workloads.tasks.discover_archives", "schedule": DISCOVERY_INTERVAL_S},
        "mark-lost-workloads": {"task": "apps.workloads.tasks.mark_lost_workloads", "schedule": 60.0},
        "requeue-stale-archives": {
            "task": "apps.workloads.tasks.requeue_stale_archives",
            "schedule": INGEST_LEASE_S / 2,
        },
        "expire-abandoned-uploads": {"task": "apps.workloads.tasks.expire_abandoned_uploads", "schedule": 3600.0},
        "purge-monitoring-points": {"task": "apps.monitoring.tasks.purge_expired_points", "schedule": 3600.0},
        "materialize-monitoring-bands": {"task": "apps.monitoring.tasks.materialize_bands", "schedule": 60.0},
    }
)
