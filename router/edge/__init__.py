"""The edge of the router: the app that maps paths to handlers, client keys and what each
may claim (priority class, tenant), admission and its fair queue, and the admin API."""

from router.edge.admin import AdminApi
from router.edge.admission import AdmissionCollector, AdmissionGate, AdmissionSettings
from router.edge.app import RouterApp
from router.edge.auth import ClientKeys, KeysFileError, serve_key_reloads
from router.edge.claims import Claims, Grants, PriorityClasses, TrafficSettings
from router.edge.fair_queue import FairQueue, TenantLimits

__all__ = [
    "AdminApi",
    "AdmissionCollector",
    "AdmissionGate",
    "AdmissionSettings",
    "Claims",
    "ClientKeys",
    "FairQueue",
    "Grants",
    "KeysFileError",
    "PriorityClasses",
    "RouterApp",
    "TenantLimits",
    "TrafficSettings",
    "serve_key_reloads",
]
