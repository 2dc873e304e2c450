// activekv._endpoint: vLLM's endpoint-plugin contract (vLLM's EndpointPlugin interface)
// in C++, with no Python of ours: `name`, `required_tasks`, `attach_router(app)` and an `init_state(...)` whose call
// returns a native awaitable; and two routes, GET /activekv/telemetry and GET /activekv/health, each a native ASGI
// application whose call returns a native awaitable that drives the server's `send`.
//
// Operational routes, placed as vLLM places its own /health and /metrics: at the root, outside the prefixes vLLM's
// --api-key guards (vllm/entrypoints/serve/middleware/authenticate.py, GUARDED_PREFIX: /v1, /v2, /inference,
// /cohere), and 503 once vLLM's engine client reports the engine dead (as vllm/entrypoints/serve/instrumentator/
// health.py answers /health on EngineDeadError).
//
// The awaitable is awaitable.cpp (awaitable.h); how it works and the CPython / vLLM source lines it relies on:
// docs/async-native.md.
// Where the numbers come from: the engines' shared telemetry segments (engine/include/activekv/telemetry.h,
// snapshot_process_tree), read in the API server process; docs/async-native.md says why not collective_rpc.
//
// Python callables this file calls, none on a per-step path (listed in intake/baseline.toml): the ASGI `send`
// (twice per HTTP request), `app.add_route` (once at start-up), `engine_client.errored` (once per request).
#include <activekv/telemetry.h>
#include <activekv_py/awaitable.h>
#include <activekv_py/common.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;
using activekv::py_glue::Job;
using activekv::py_glue::make_awaitable;
using activekv::py_glue::Step;

namespace {

// ---------------------------------------------------------------------------------------------------------------
// The plugin, its state and its routes.
// ---------------------------------------------------------------------------------------------------------------

constexpr const char* kTelemetryPath = "/activekv/telemetry";
constexpr const char* kHealthPath = "/activekv/health";

/// Shared by the plugin and its routes: what init_state recorded.
struct PluginState {
  bool initialized = false;  ///< init_state ran
  py::object engine_client;  ///< vLLM's EngineClient; None on the CPU-only render server (no engine)
};

struct Response {
  int status = 200;
  std::string body;
  std::vector<std::pair<std::string, std::string>> extra_headers;
};

/// A JSON number as Python's json.dumps writes a float (repr); null for inf and nan, which JSON lacks.
std::string json_num(double v) { return std::isfinite(v) ? activekv::float_repr(v) : "null"; }

/// vLLM's error body shape (ErrorResponse: {"error": {"message", "type", "param", "code"}}).
Response error_response(int status, const std::string& type, const std::string& message) {
  using activekv::json_string;
  return {status, "{\"error\": {\"message\": " + json_string(message) + ", \"type\": " + json_string(type) +
                      ", \"param\": null, \"code\": " + std::to_string(status) + "}}", {}};
}

/// Error when the routes cannot answer from an engine (init_state not run, or no engine: vLLM's render server).
bool engine_missing(const PluginState& st, Response* out) {
  if (!st.initialized) {
    *out = error_response(500, "ActiveKVNotInitialized",
                          "the activekv endpoint plugin's init_state has not run: this app was not set up by vLLM's "
                          "init_app_state");
    return true;
  }
  if (st.engine_client.is_none()) {
    *out = error_response(500, "ActiveKVNoEngine",
                          "this vLLM server has no engine (the CPU-only render server): no ActiveKV telemetry");
    return true;
  }
  return false;
}

/// 503 when vLLM's engine client reports that the engine core died (EngineClient.errored: a property of the client
/// object in this process, no engine round trip), as vLLM's own /health answers then.
bool engine_dead(const PluginState& st, Response* out) {
  if (!st.engine_client.attr("errored").cast<bool>()) return false;
  *out = error_response(503, "EngineDeadError", "vLLM's engine client reports the engine has errored");
  return true;
}

/// The telemetry of every live engine in this process tree (the engine-core and worker processes' shared segments).
std::vector<activekv::PublishedTelemetry> published_engines(Response* out) {
  std::vector<activekv::PublishedTelemetry> published;
  {
    py::gil_scoped_release release;  // reads /proc and maps files: let other Python threads run meanwhile
    published = activekv::snapshot_process_tree();
  }
  if (published.empty()) {
    // Where the folder itself is the reason (missing, not private to this user), say so rather than guess.
    std::string problem;
    {
      py::gil_scoped_release release;
      problem = activekv::telemetry_dir_problem();
    }
    *out = error_response(500, "ActiveKVTelemetryUnavailable",
                          "no ActiveKV engine publishes telemetry in this server's processes (segments in " +
                              activekv::telemetry_dir() + "): " +
                              (problem.empty() ? "the attention backend is not ACTIVEKV, the engine has not started, "
                                                 "or its segment was removed"
                                               : problem + " (ACTIVEKV_TELEMETRY_DIR chooses the parent folder)"));
  }
  return published;
}

std::string pids_json(const std::vector<activekv::PublishedTelemetry>& published) {
  std::string s = "[";
  int64_t last = -1;
  for (const auto& p : published) {
    if (p.pid == last) continue;
    s += (last == -1 ? "" : ", ") + std::to_string(p.pid);
    last = p.pid;
  }
  return s + "]";
}

activekv::TelemetrySnapshot merged(const std::vector<activekv::PublishedTelemetry>& published) {
  std::vector<activekv::TelemetrySnapshot> all;
  for (const auto& p : published) all.push_back(p.snapshot);
  return activekv::merge_snapshots(all);
}

int64_t gauge(const activekv::TelemetrySnapshot& s, activekv::Gauge g) {
  const auto key = activekv::gauge_name(g);
  for (const auto& [k, v] : s.gauges)
    if (k == key) return v;
  return 0;
}

/// GET /activekv/telemetry: {"engines": n, "pids": [...], "counters", "histograms", "info", "gauges"} summed over
/// the engines of this server's processes (the same numbers as /metrics' activekv_* families).
Response telemetry_response(const PluginState& st) {
  Response r;
  if (engine_missing(st, &r) || engine_dead(st, &r)) return r;
  const auto published = published_engines(&r);
  if (published.empty()) return r;
  const std::string core = activekv::snapshot_to_json(merged(published), /*with_gauges=*/true);
  r.body = "{\"object\": \"activekv.telemetry\", \"engines\": " + std::to_string(published.size()) +
           ", \"pids\": " + pids_json(published) + ", " + core.substr(1);
  return r;
}

/// GET /activekv/health: mode, pool occupancy and last step time; 503 when vLLM's engine client reports an error.
Response health_response(const PluginState& st) {
  Response r;
  if (engine_missing(st, &r) || engine_dead(st, &r)) return r;
  const auto published = published_engines(&r);
  if (published.empty()) return r;
  const activekv::TelemetrySnapshot s = merged(published);
  const int64_t mode = gauge(s, activekv::Gauge::kMode);
  const int64_t resident = gauge(s, activekv::Gauge::kPoolResidentBlocks);
  const int64_t capacity = gauge(s, activekv::Gauge::kPoolCapacityBlocks);
  const int64_t last_us = gauge(s, activekv::Gauge::kLastStepUnixUs);
  const int64_t now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  const char* mode_name = mode == 0 ? "exact" : mode == 1 ? "compressed" : "mixed";
  r.body = std::string("{\"object\": \"activekv.health\", \"status\": \"ok\", \"mode\": \"") + mode_name +
           "\", \"engines\": " + std::to_string(published.size()) + ", \"pids\": " + pids_json(published) +
           ", \"pool\": {\"resident_blocks\": " + std::to_string(resident) +
           ", \"capacity_blocks\": " + std::to_string(capacity) + ", \"occupancy\": " +
           (capacity > 0 ? json_num(static_cast<double>(resident) / static_cast<double>(capacity)) : "null") +
           "}, \"last_step\": " +
           (last_us > 0 ? "{\"unix_time\": " + json_num(static_cast<double>(last_us) * 1e-6) +
                              ", \"age_s\": " + json_num(static_cast<double>(now_us - last_us) * 1e-6) +
                              ", \"forward_us\": " + std::to_string(gauge(s, activekv::Gauge::kLastForwardUs)) + "}"
                        : std::string("null")) +
           "}";
  return r;
}

enum class RouteKind { kTelemetry, kHealth };

/// One HTTP request: compute the response, then await send(http.response.start) and send(http.response.body).
class ResponseJob : public Job {
 public:
  ResponseJob(RouteKind kind, std::shared_ptr<PluginState> st, std::string method, py::object send)
      : kind_(kind), st_(std::move(st)), method_(std::move(method)), send_(std::move(send)) {}

  Step advance(py::object) override {
    switch (stage_++) {
      case 0: {
        Response r = respond();
        body_ = py::bytes(method_ == "HEAD" ? std::string() : r.body);
        py::list headers;
        headers.append(py::make_tuple(py::bytes("content-type"), py::bytes("application/json")));
        headers.append(py::make_tuple(py::bytes("content-length"), py::bytes(std::to_string(r.body.size()))));
        for (const auto& [k, v] : r.extra_headers) headers.append(py::make_tuple(py::bytes(k), py::bytes(v)));
        py::dict start;
        start["type"] = "http.response.start";
        start["status"] = r.status;
        start["headers"] = headers;
        return {send_(start), py::object()};
      }
      case 1: {
        py::dict body;
        body["type"] = "http.response.body";
        body["body"] = body_;
        body["more_body"] = false;
        return {send_(body), py::object()};
      }
      default:
        return {py::object(), py::none()};
    }
  }

 private:
  /// The response, never an exception: any failure becomes a 500 with a JSON body (the server keeps serving); a dead
  /// engine a 503.
  Response respond() {
    if (method_ != "GET" && method_ != "HEAD") {
      Response r = error_response(405, "MethodNotAllowed", "method " + method_ + " not allowed: use GET");
      r.extra_headers.emplace_back("allow", "GET, HEAD");
      return r;
    }
    try {
      return kind_ == RouteKind::kTelemetry ? telemetry_response(*st_) : health_response(*st_);
    } catch (py::error_already_set& e) {
      const std::string what = e.what();
      e.discard_as_unraisable(__func__);  // logged by Python's unraisable hook; the client gets the JSON below
      return error_response(500, "InternalServerError", what);
    } catch (const std::exception& e) {
      return error_response(500, "InternalServerError", e.what());
    }
  }

  RouteKind kind_;
  std::shared_ptr<PluginState> st_;
  std::string method_;
  py::object send_;
  py::bytes body_;
  int stage_ = 0;
};

/// init_state(engine_client, state, args): records the engine client (None on the render server). Nothing to await:
/// the awaitable returns None at its first step.
class InitStateJob : public Job {
 public:
  InitStateJob(std::shared_ptr<PluginState> st, py::object engine_client)
      : st_(std::move(st)), engine_client_(std::move(engine_client)) {}
  Step advance(py::object) override {
    st_->engine_client = engine_client_;
    st_->initialized = true;
    return {py::object(), py::none()};
  }

 private:
  std::shared_ptr<PluginState> st_;
  py::object engine_client_;
};

/// A route's ASGI application: app(scope, receive, send) -> native awaitable.
struct AsgiRoute {
  RouteKind kind;
  std::string path;
  std::string name;  ///< __name__: vLLM logs every route without methods by its endpoint's __name__
  std::shared_ptr<PluginState> st;
};

struct EndpointPlugin {
  std::shared_ptr<PluginState> st = std::make_shared<PluginState>();
};

std::string type_name(const py::handle& o) { return Py_TYPE(o.ptr())->tp_name; }

}  // namespace

PYBIND11_MODULE(_endpoint, m) {
  m.doc() =
      "ActiveKV's vLLM endpoint plugin (group vllm.endpoint_plugins, contract vllm/plugins/endpoint_plugins/"
      "interface.py), native: GET /activekv/telemetry and GET /activekv/health served by native ASGI applications "
      "whose awaitables drive the server's send; outside /v1, so without vLLM's API key, like vLLM's /health and "
      "/metrics. docs/async-native.md.";
  activekv::py_glue::register_exceptions(m);
  activekv::py_glue::register_awaitable(m);
  m.attr("TELEMETRY_PATH") = kTelemetryPath;
  m.attr("HEALTH_PATH") = kHealthPath;

  // dynamic_attr: each instance carries its own __name__ (set in attach_router), which a class-level descriptor
  // cannot give: `__name__` on a class is the type's own name.
  py::class_<AsgiRoute>(m, "AsgiRoute", py::dynamic_attr(),
                        "A native ASGI application for one route: calling it with (scope, receive, send) returns an "
                        "Awaitable that sends http.response.start and http.response.body (application/json).")
      .def_readonly("path", &AsgiRoute::path)

      .def(
          "__call__",
          [](const AsgiRoute& r, py::object scope, py::object receive, py::object send) {
            if (!PyDict_Check(scope.ptr()))
              throw py::type_error("ASGI scope must be a dict, got " + type_name(scope));
            if (!PyCallable_Check(send.ptr()))
              throw py::type_error("ASGI send must be callable, got " + type_name(send));
            py::dict s = scope.cast<py::dict>();
            if (!s.contains("type") || !py::isinstance<py::str>(s["type"]) || s["type"].cast<std::string>() != "http")
              throw py::value_error("ActiveKV's " + r.path + " route serves ASGI 'http' scopes only, got type " +
                                    (s.contains("type") ? py::repr(s["type"]).cast<std::string>() : "(missing)"));
            if (!s.contains("method") || !py::isinstance<py::str>(s["method"]))
              throw py::value_error("ASGI http scope must hold 'method' as a str");
            return make_awaitable(
                std::make_unique<ResponseJob>(r.kind, r.st, s["method"].cast<std::string>(), std::move(send)));
          },
          py::arg("scope"), py::arg("receive"), py::arg("send"),
          "ASGI: returns the Awaitable that answers this request (405 for methods other than GET and HEAD, 503 with "
          "a JSON body when vLLM's engine client reports the engine dead, 500 with one when the telemetry cannot be "
          "read). TypeError/ValueError for a scope that is not an http one.")
      .def("__repr__", [](const AsgiRoute& r) { return "<activekv._endpoint.AsgiRoute " + r.path + ">"; });

  py::class_<EndpointPlugin>(m, "EndpointPlugin",
                             "vLLM's EndpointPlugin protocol: the zero-argument factory the `activekv` entry point of "
                             "group vllm.endpoint_plugins names.")
      .def(py::init<>())
      .def_property_readonly("name", [](const EndpointPlugin&) { return "activekv"; },
                             "Plugin name, also the name VLLM_PLUGINS must list.")
      .def_property_readonly("required_tasks", [](const EndpointPlugin&) { return py::none(); },
                             "None: no task requirement (on the render server, which has no engine, the routes "
                             "answer 500).")
      .def_property_readonly("initialized", [](const EndpointPlugin& p) { return p.st->initialized; },
                             "Whether init_state ran.")
      .def(
          "attach_router",
          [](const EndpointPlugin& p, py::object app) {
            if (!py::hasattr(app, "add_route"))
              throw py::type_error("attach_router expects a FastAPI/Starlette application (with add_route), got " +
                                   type_name(app));
            for (const auto& [kind, path, name] :
                 {std::tuple{RouteKind::kTelemetry, kTelemetryPath, "activekv_telemetry"},
                  std::tuple{RouteKind::kHealth, kHealthPath, "activekv_health"}}) {
              // Starlette's Route treats an endpoint that is not a Python function or method as an ASGI app;
              // methods=None: every method reaches it (405 is ours).
              py::object route = py::cast(AsgiRoute{kind, path, name, p.st});
              // vLLM's serve_http logs `endpoint.__name__` of every route registered without methods: a route
              // object without one stops the server (docs/async-native.md).
              route.attr("__name__") = name;
              app.attr("add_route")(path, route, py::arg("methods") = py::none(), py::arg("name") = name,
                                    py::arg("include_in_schema") = false);
            }
          },
          py::arg("app"),
          "Registers GET /activekv/telemetry and GET /activekv/health on app (app.add_route). TypeError when app "
          "has no add_route.")
      .def(
          "init_state",
          [](const EndpointPlugin& p, py::object engine_client, py::object state, py::object args) {
            return make_awaitable(std::make_unique<InitStateJob>(p.st, std::move(engine_client)));
          },
          py::arg("engine_client"), py::arg("state"), py::arg("args"),
          "async contract method: returns an Awaitable that records engine_client (None on the render server) for "
          "the routes and returns None.");
}
