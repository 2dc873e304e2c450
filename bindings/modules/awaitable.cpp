// The native awaitable of the _endpoint module (awaitable.h): CPython's async protocol in C++ (am_await, am_send,
// tp_iternext, send/throw/close) driving a Job, the awaitables it awaits and what they yield to the event loop.
// docs/async-native.md says how it works and why each piece exists.
#include <activekv_py/awaitable.h>

#include <memory>
#include <utility>

namespace activekv::py_glue {

namespace {

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

}  // namespace

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

void register_awaitable(py::module_& m) {
  awaitable_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&aw_spec));
  if (awaitable_type == nullptr) throw py::error_already_set();
  m.attr("Awaitable") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(awaitable_type));
}

}  // namespace activekv::py_glue
