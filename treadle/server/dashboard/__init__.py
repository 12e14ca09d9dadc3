"""The live dashboard at /dashboard: `router.py` serves the page (static files in `static/`, no
build step, no CDN) and its once-a-second feed from the engine's `LiveFeed`."""
