"""The edge of the router: the app that maps paths to handlers, client keys, admission, and the admin API."""
