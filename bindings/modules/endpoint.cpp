// activekv._endpoint: vLLM's endpoint-plugin contract (vllm/plugins/endpoint_plugins/interface.py, EndpointPlugin)
// in C++, with no Python of ours: `name`, `required_tasks`, `attach_router(app)` and an `init_state(...)` whose call
// returns a native awaitable; and two routes, GET /v1/activekv/telemetry and GET /v1/activekv/health, each a native
// ASGI application whose call returns a native awaitable that drives the server's `send`.
//
// How the awaitable works, why each piece exists and the CPython / vLLM source lines it relies on: docs/async-native.md.
// Where the numbers come from: the engines' shared telemetry segments (engine/include/activekv/telemetry.h,
// snapshot_process_tree), read in the API server process; docs/async-native.md says why not collective_rpc.
//
// Python callables this file calls, none on a per-step path (listed in intake/baseline.toml): the ASGI `send`
// (twice per HTTP request), `app.add_route` (once at start-up), `engine_client.errored` (once per health request).
#include <activekv/telemetry.h>
#include <activekv_py/common.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------------------------------------------------------
// The native awaitable: a coroutine written as a C++ state machine (a Job), exposed through CPython's async protocol.
// ---------------------------------------------------------------------------------------------------------------

/// What a Job asks for next: an awaitable to await (its result is passed to the next advance()), or, when
/// `awaitable` is null, the coroutine's return value.
struct Step {
  py::object awaitable;
  py::object result;
};

/// The body of a native coroutine. advance() runs with the GIL held: first with None, then with the result of each
/// awaitable it returned. A Python exception (py::error_already_set) or a C++ exception ends the coroutine with it.
class Job {
 public:
  virtual ~Job() = default;
  virtual Step advance(py::object last) = 0;
};

/// The awaitable and its own iterator (what `__await__` returns), as a coroutine object is for itself in CPython.
struct AwaitableObject {
  PyObject_HEAD
  Job* job;          ///< owned; null once finished
  PyObject* inner;   ///< iterator of the awaitable being awaited now (strong reference), or null
  int state;         ///< 0 not started, 1 running, 2 finished
  int awaited;       ///< __await__ was called (an awaitable is awaited once)
  int running;       ///< inside send/throw/close: Python code it runs may not re-enter it (as a running generator)
};

PyTypeObject* awaitable_type = nullptr;  // created in PYBIND11_MODULE (a heap type, PyType_FromSpec)

void finish(AwaitableObject* self) {
  delete self->job;
  self->job = nullptr;
  Py_CLEAR(self->inner);
  self->state = 2;
}

/// Whether `o` is a generator-based coroutine (a generator whose code has CO_ITERABLE_COROUTINE: @types.coroutine).
bool iterable_coroutine(PyObject* o) {
  if (!PyGen_CheckExact(o)) return false;
  PyObject* code = PyObject_GetAttrString(o, "gi_code");  // a generator's code object (PyGenObject is opaque)
  if (code == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool yes = PyCode_Check(code) && (reinterpret_cast<PyCodeObject*>(code)->co_flags & CO_ITERABLE_COROUTINE);
  Py_DECREF(code);
  return yes;
}

/// The iterator to drive for `o` in an await expression, as CPython's _PyCoro_GetAwaitableIter (Objects/genobject.c)
/// finds it: a coroutine, or a generator-based coroutine, is driven directly (it implements am_send); any other
/// object through its am_await slot (`__await__`), whose result must be an iterator and not a coroutine. New
/// reference, or null with TypeError set.
PyObject* awaitable_iter(PyObject* o) {
  if (PyCoro_CheckExact(o) || iterable_coroutine(o)) {
    Py_INCREF(o);
    return o;
  }
  PyAsyncMethods* am = Py_TYPE(o)->tp_as_async;
  if (am == nullptr || am->am_await == nullptr) {
    PyErr_Format(PyExc_TypeError,
                 "ActiveKV awaited an object of type %.100s, which is not awaitable (no __await__)",
                 Py_TYPE(o)->tp_name);
    return nullptr;
  }
  PyObject* it = am->am_await(o);
  if (it == nullptr) return nullptr;
  if (PyCoro_CheckExact(it) || !PyIter_Check(it)) {
    PyErr_Format(PyExc_TypeError, "__await__() of %.100s returned a non-iterator of type %.100s",
                 Py_TYPE(o)->tp_name, Py_TYPE(it)->tp_name);
    Py_DECREF(it);
    return nullptr;
  }
  return it;
}

/// Send `value` into the awaitable the job is suspended in (what `yield from` does). PYGEN_NEXT: it yielded *out
/// (still suspended). PYGEN_RETURN: it returned *out (inner released). PYGEN_ERROR: it raised (inner released, the
/// awaitable finished).
PySendResult send_inner(AwaitableObject* self, PyObject* value, PyObject** out) {
  const PySendResult s = PyIter_Send(self->inner, value, out);
  if (s != PYGEN_NEXT) {
    Py_CLEAR(self->inner);
    if (s == PYGEN_ERROR) finish(self);
  }
  return s;
}

/// Run the job from the result `last` (stolen) of the awaitable that just finished, until it either awaits
/// something that yields (PYGEN_NEXT: the yielded value goes out to our awaiter, i.e. the event loop), returns
/// (PYGEN_RETURN) or fails (PYGEN_ERROR, exception set).
PySendResult run_job(AwaitableObject* self, PyObject* last, PyObject** presult) {
  for (;;) {
    Step step;
    try {
      step = self->job->advance(py::reinterpret_steal<py::object>(last));
    } catch (py::error_already_set& e) {
      e.restore();
      finish(self);
      return PYGEN_ERROR;
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      finish(self);
      return PYGEN_ERROR;
    }
    if (!step.awaitable) {
      *presult = step.result ? step.result.release().ptr() : Py_NewRef(Py_None);
      finish(self);
      return PYGEN_RETURN;
    }
    self->inner = awaitable_iter(step.awaitable.ptr());
    if (self->inner == nullptr) {
      finish(self);
      return PYGEN_ERROR;
    }
    PyObject* r = nullptr;
    const PySendResult s = send_inner(self, Py_None, &r);  // start it: the first value sent is None
    if (s != PYGEN_RETURN) {
      if (s == PYGEN_NEXT) *presult = r;
      return s;
    }
    last = r;  // it returned at once: go on with its result
  }
}

/// Marks the awaitable running for a scope; refuses re-entry (the job's C++ frame is live: closing it from inside
/// would free it under that frame), as CPython refuses a generator that is already executing.
class Running {
 public:
  explicit Running(AwaitableObject* self) : self_(self), ok_(self->running == 0) {
    if (ok_) self_->running = 1;
    else PyErr_SetString(PyExc_ValueError, "ActiveKV awaitable already executing");
  }
  ~Running() {
    if (ok_) self_->running = 0;
  }
  bool ok() const { return ok_; }

 private:
  AwaitableObject* self_;
  bool ok_;
};

PySendResult am_send_running(AwaitableObject* self, PyObject* value, PyObject** presult);

/// am_send: the whole protocol in one function (PyIter_Send calls it; so do send(), __next__ and the SEND opcode).
PySendResult aw_am_send(PyObject* o, PyObject* value, PyObject** presult) {
  auto* self = reinterpret_cast<AwaitableObject*>(o);
  Running running(self);
  if (!running.ok()) return PYGEN_ERROR;
  return am_send_running(self, value, presult);
}

PySendResult am_send_running(AwaitableObject* self, PyObject* value, PyObject** presult) {
  if (self->state == 2 || self->job == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "cannot reuse an ActiveKV awaitable that already finished");
    return PYGEN_ERROR;
  }
  if (self->state == 0) {
    if (value != Py_None) {
      PyErr_Format(PyExc_TypeError, "can't send a non-None value (%.100s) to a just-started ActiveKV awaitable",
                   Py_TYPE(value)->tp_name);
      return PYGEN_ERROR;
    }
    self->state = 1;
    return run_job(self, Py_NewRef(Py_None), presult);
  }
  // Running: suspended inside `inner`, which yielded to the event loop. Forward the value sent back in.
  if (self->inner == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "ActiveKV awaitable is not suspended in an awaitable");
    finish(self);
    return PYGEN_ERROR;
  }
  PyObject* r = nullptr;
  const PySendResult s = send_inner(self, value, &r);
  if (s != PYGEN_RETURN) {
    if (s == PYGEN_NEXT) *presult = r;
    return s;
  }
  return run_job(self, r, presult);
}

/// StopIteration(value) set as the current exception: how an iterator returns a value (PEP 380). The value is wrapped
/// in an instance so a tuple or an exception value is not taken apart (as CPython's _PyGen_SetStopIterationValue).
void set_stop_iteration(PyObject* value) {
  if (value == Py_None) {
    PyErr_SetNone(PyExc_StopIteration);
    return;
  }
  PyObject* e = PyObject_CallOneArg(PyExc_StopIteration, value);
  if (e != nullptr) {
    PyErr_SetObject(PyExc_StopIteration, e);
    Py_DECREF(e);
  }
}

/// Result of am_send as a method call returns it: the yielded value, or null with StopIteration / the error set.
PyObject* as_call_result(PySendResult s, PyObject* r) {
  if (s == PYGEN_NEXT) return r;
  if (s == PYGEN_RETURN) {
    set_stop_iteration(r);
    Py_DECREF(r);
  }
  return nullptr;
}

PyObject* aw_await(PyObject* o) {
  auto* self = reinterpret_cast<AwaitableObject*>(o);
  if (self->awaited) {
    PyErr_SetString(PyExc_RuntimeError, "an ActiveKV awaitable can be awaited only once");
    return nullptr;
  }
  self->awaited = 1;
  return Py_NewRef(o);
}

PyObject* aw_iternext(PyObject* o) {
  PyObject* r = nullptr;
  const PySendResult s = aw_am_send(o, Py_None, &r);
  if (s == PYGEN_NEXT) return r;
  if (s == PYGEN_RETURN) {
    if (r != Py_None) set_stop_iteration(r);  // null without an exception: exhausted, returning None
    Py_DECREF(r);
  }
  return nullptr;
}

PyObject* aw_send(PyObject* o, PyObject* value) {
  PyObject* r = nullptr;
  const PySendResult s = aw_am_send(o, value, &r);
  return as_call_result(s, r);
}

/// Raise throw()'s arguments (exc), (type[, value[, traceback]]) as the current exception.
void raise_thrown(PyObject* args) {
  PyObject* typ = PyTuple_GET_ITEM(args, 0);
  PyObject* val = PyTuple_GET_SIZE(args) > 1 ? PyTuple_GET_ITEM(args, 1) : Py_None;
  if (PyExceptionInstance_Check(typ)) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(typ)), typ);
  } else if (PyExceptionClass_Check(typ)) {
    PyErr_SetObject(typ, val);
  } else {
    PyErr_Format(PyExc_TypeError, "exceptions must be classes or instances deriving from BaseException, not %.100s",
                 Py_TYPE(typ)->tp_name);
  }
}

/// throw(): the event loop cancels a task by throwing CancelledError into the coroutine it awaits. Forward it into
/// `inner` when it has throw() (a coroutine, a generator); otherwise raise it here, which ends this awaitable.
PyObject* aw_throw(PyObject* o, PyObject* args) {
  auto* self = reinterpret_cast<AwaitableObject*>(o);
  Running running(self);
  if (!running.ok()) return nullptr;
  if (PyTuple_GET_SIZE(args) < 1 || PyTuple_GET_SIZE(args) > 3) {
    PyErr_SetString(PyExc_TypeError, "throw() takes 1 to 3 arguments (exception[, value[, traceback]])");
    return nullptr;
  }
  if (self->state == 1 && self->inner != nullptr) {
    PyObject* meth = PyObject_GetAttrString(self->inner, "throw");
    if (meth == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
        finish(self);
        return nullptr;
      }
      PyErr_Clear();  // no throw(): raise it here
    }
    if (meth != nullptr) {
      PyObject* r = PyObject_Call(meth, args, nullptr);
      Py_DECREF(meth);
      if (r != nullptr) return r;  // inner handled it and yielded again
      Py_CLEAR(self->inner);
      if (!PyErr_ExceptionMatches(PyExc_StopIteration)) {
        finish(self);
        return nullptr;
      }
      // inner handled it and returned: go on with its value.
      PyObject *typ = nullptr, *exc = nullptr, *tb = nullptr;
      PyErr_Fetch(&typ, &exc, &tb);  // Python 3.10/3.11 API (PyErr_GetRaisedException is 3.12+)
      PyErr_NormalizeException(&typ, &exc, &tb);
      PyObject* value = exc != nullptr ? PyObject_GetAttrString(exc, "value") : Py_NewRef(Py_None);
      Py_XDECREF(typ);
      Py_XDECREF(exc);
      Py_XDECREF(tb);
      if (value == nullptr) {
        finish(self);
        return nullptr;
      }
      PyObject* res = nullptr;
      const PySendResult s = run_job(self, value, &res);  // before reading res (argument order is unspecified)
      return as_call_result(s, res);
    }
  }
  finish(self);
  raise_thrown(args);
  return nullptr;
}

PyObject* aw_close(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<AwaitableObject*>(o);
  Running running(self);
  if (!running.ok()) return nullptr;
  PyObject* inner = self->inner;
  self->inner = nullptr;
  finish(self);
  if (inner != nullptr) {
    PyObject* r = PyObject_CallMethod(inner, "close", nullptr);
    Py_DECREF(inner);
    if (r == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return nullptr;
      PyErr_Clear();  // an iterator without close(): nothing to close
    } else {
      Py_DECREF(r);
    }
  }
  Py_RETURN_NONE;
}

void aw_dealloc(PyObject* o) {
  auto* self = reinterpret_cast<AwaitableObject*>(o);
  PyTypeObject* tp = Py_TYPE(o);
  finish(self);
  tp->tp_free(o);
  Py_DECREF(tp);  // instances of a heap type hold a reference to it
}

PyMethodDef aw_methods[] = {
    {"send", aw_send, METH_O, "send(value): resume with value; returns the next yielded value or raises StopIteration."},
    {"throw", aw_throw, METH_VARARGS, "throw(exc): raise exc where the awaitable is suspended (forwarded to the "
                                      "awaitable it awaits when that has throw())."},
    {"close", aw_close, METH_NOARGS, "close(): end the awaitable (closing the one it awaits)."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot aw_slots[] = {
    {Py_am_await, reinterpret_cast<void*>(aw_await)},
    {Py_am_send, reinterpret_cast<void*>(aw_am_send)},
    {Py_tp_iter, reinterpret_cast<void*>(PyObject_SelfIter)},
    {Py_tp_iternext, reinterpret_cast<void*>(aw_iternext)},
    {Py_tp_methods, aw_methods},
    {Py_tp_dealloc, reinterpret_cast<void*>(aw_dealloc)},
    {Py_tp_doc, const_cast<char*>(
        "A native awaitable (CPython's async protocol in C++): __await__ returns the object itself, an iterator that "
        "drives the awaitables its C++ body awaits (forwarding what they yield to the event loop, and send()/throw() "
        "back into them) and finishes with StopIteration(result). Awaited once. Not constructible from Python.")},
    {0, nullptr}};

// DISALLOW_INSTANTIATION (3.10+): a heap type would otherwise inherit object's tp_new, and Awaitable() would make an
// object with no job.
PyType_Spec aw_spec = {"activekv._endpoint.Awaitable", sizeof(AwaitableObject), 0,
                       Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, aw_slots};

py::object make_awaitable(std::unique_ptr<Job> job) {
  PyObject* o = awaitable_type->tp_alloc(awaitable_type, 0);
  if (o == nullptr) throw py::error_already_set();
  auto* self = reinterpret_cast<AwaitableObject*>(o);
  self->job = job.release();
  self->inner = nullptr;
  self->state = 0;
  self->awaited = 0;
  self->running = 0;
  return py::reinterpret_steal<py::object>(o);
}

// ---------------------------------------------------------------------------------------------------------------
// The plugin, its state and its routes.
// ---------------------------------------------------------------------------------------------------------------

constexpr const char* kTelemetryPath = "/v1/activekv/telemetry";
constexpr const char* kHealthPath = "/v1/activekv/health";

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

std::string json_num(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);  // shortest round-trip form, as Python's repr
  return std::string(buf, res.ptr);
}

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

/// The telemetry of every live engine in this process tree (the engine-core and worker processes' shared segments).
std::vector<activekv::PublishedTelemetry> published_engines(Response* out) {
  std::vector<activekv::PublishedTelemetry> published;
  {
    py::gil_scoped_release release;  // reads /proc and maps files: let other Python threads run meanwhile
    published = activekv::snapshot_process_tree();
  }
  if (published.empty()) {
    *out = error_response(500, "ActiveKVTelemetryUnavailable",
                          "no ActiveKV engine publishes telemetry in this server's processes (segments in " +
                              activekv::telemetry_dir() +
                              "): the attention backend is not ACTIVEKV, the engine has not started, or its "
                              "segment was removed");
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

/// GET /v1/activekv/telemetry: {"engines": n, "pids": [...], "counters", "histograms", "info", "gauges"} summed over
/// the engines of this server's processes (the same numbers as /metrics' activekv_* families).
Response telemetry_response(const PluginState& st) {
  Response r;
  if (engine_missing(st, &r)) return r;
  const auto published = published_engines(&r);
  if (published.empty()) return r;
  const std::string core = activekv::snapshot_to_json(merged(published), /*with_gauges=*/true);
  r.body = "{\"object\": \"activekv.telemetry\", \"engines\": " + std::to_string(published.size()) +
           ", \"pids\": " + pids_json(published) + ", " + core.substr(1);
  return r;
}

/// GET /v1/activekv/health: mode, pool occupancy, last step time, and whether vLLM's engine client reports an error.
Response health_response(const PluginState& st) {
  Response r;
  if (engine_missing(st, &r)) return r;
  // EngineClient.errored (vllm/engine/protocol.py): the engine core died. A property of the client object in this
  // process, no engine round trip.
  const bool errored = st.engine_client.attr("errored").cast<bool>();
  if (errored) {
    return error_response(500, "EngineDeadError", "vLLM's engine client reports the engine has errored");
  }
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
  /// The response, never an exception: any failure becomes a 500 with a JSON body (the server keeps serving).
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
      "interface.py), native: GET /v1/activekv/telemetry and GET /v1/activekv/health served by native ASGI "
      "applications whose awaitables drive the server's send. docs/async-native.md.";
  activekv::py_glue::register_exceptions(m);
  awaitable_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&aw_spec));
  if (awaitable_type == nullptr) throw py::error_already_set();
  m.attr("Awaitable") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(awaitable_type));
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
          "ASGI: returns the Awaitable that answers this request (405 for methods other than GET and HEAD, 500 with "
          "a JSON body when the telemetry cannot be read). TypeError/ValueError for a scope that is not an http one.")
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
              // Starlette's Route treats an endpoint that is not a Python function or method as an ASGI app
              // (starlette/routing.py, Route.__init__); methods=None: every method reaches it (405 is ours).
              py::object route = py::cast(AsgiRoute{kind, path, name, p.st});
              // vLLM's serve_http logs `endpoint.__name__` of every route registered without methods
              // (vllm/entrypoints/launchers/launcher.py:198-206): a route object without one stops the server.
              route.attr("__name__") = name;
              app.attr("add_route")(path, route, py::arg("methods") = py::none(), py::arg("name") = name,
                                    py::arg("include_in_schema") = false);
            }
          },
          py::arg("app"),
          "Registers GET /v1/activekv/telemetry and GET /v1/activekv/health on app (app.add_route). TypeError when "
          "app has no add_route.")
      .def(
          "init_state",
          [](const EndpointPlugin& p, py::object engine_client, py::object state, py::object args) {
            return make_awaitable(std::make_unique<InitStateJob>(p.st, std::move(engine_client)));
          },
          py::arg("engine_client"), py::arg("state"), py::arg("args"),
          "async contract method: returns an Awaitable that records engine_client (None on the render server) for "
          "the routes and returns None.");
}
