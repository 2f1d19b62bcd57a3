"""The web console `pagoda serve` answers at `/`: a live engine dashboard, a chat playground and
benchmark reports, as hand-written static files (static/) served from the package, with no build
step and nothing fetched from elsewhere. The page reads the engine through endpoints of its own
under /console/api (routes.py), fed from what the server already records (feed.py)."""
