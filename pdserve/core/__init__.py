"""The engine pieces every service shares. Imports no service and no generated protobuf code;
modules that need torch import it themselves, so the router can use the rest without it."""
