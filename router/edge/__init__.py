"""The edge of the router: the app that maps paths to handlers, client keys, admission, and the admin API."""

from router.edge.admin import AdminApi
from router.edge.admission import AdmissionCollector, AdmissionGate, AdmissionSettings
from router.edge.app import RouterApp
from router.edge.auth import ClientKeys, KeysFileError, serve_key_reloads

__all__ = [
    "AdminApi",
    "AdmissionCollector",
    "AdmissionGate",
    "AdmissionSettings",
    "ClientKeys",
    "KeysFileError",
    "RouterApp",
    "serve_key_reloads",
]
