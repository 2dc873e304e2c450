// A module written against CPython's C API, without pybind11: the entries of its method tables (PyMethodDef), member
// tables (PyMemberDef) and property tables (PyGetSetDef) are bindings, as pybind11's .def calls are. A per-step method
// (named build, forward, ...) that calls a Python object, and a binding that keeps a Python object it was handed (in a
// static or a member) that the per-step path reads: rejected. Their benign twins are in c_api_module_ok.cpp.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <cstddef>

namespace corpus_c_api_module {

PyObject* g_hook = nullptr;  // a Python callable the module keeps beyond the call that handed it over

struct Engine {
  PyObject_HEAD
  PyObject* on_step;   // set through a method
  PyObject* on_evict;  // set through a property
  PyObject* progress;  // a writable member
  long steps;
};

Engine* engine(PyObject* self) { return reinterpret_cast<Engine*>(self); }

PyObject* set_hook(PyObject*, PyObject* fn) {
  Py_XINCREF(fn);
  Py_XDECREF(g_hook);
  g_hook = fn;
  Py_RETURN_NONE;
}

PyObject* forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return PyObject_Vectorcall(g_hook, args, nargs, nullptr);  // expect: per-step-python-callback
}

PyObject* Engine_set_on_step(PyObject* self, PyObject* fn) {
  Py_XINCREF(fn);
  engine(self)->on_step = fn;
  Py_RETURN_NONE;
}

PyObject* Engine_forward(PyObject* self, PyObject* args) {
  Engine* e = engine(self);
  e->steps += 1;
  PyObject* r = PyObject_CallObject(e->on_step, args);  // expect: per-step-python-callback
  Py_XDECREF(r);
  return PyObject_CallFunction(e->progress, "l", e->steps);  // expect: per-step-python-callback
}

PyObject* Engine_build(PyObject* self, PyObject*) { return PyBool_FromLong(engine(self)->on_evict != nullptr); }

PyObject* Engine_get_on_evict(PyObject* self, void*) { return Py_NewRef(engine(self)->on_evict); }

int Engine_set_on_evict(PyObject* self, PyObject* value, void*) {
  Py_XINCREF(value);
  engine(self)->on_evict = value;
  return 0;
}

PyMethodDef module_methods[] = {
    {"set_hook", set_hook, METH_O, "set_hook(fn): keeps fn."},  // expect: per-step-python-callback
    {"forward", _PyCFunction_CAST(forward), METH_FASTCALL, "forward(*args): calls the hook."},
    {nullptr, nullptr, 0, nullptr}};

PyMethodDef engine_methods[] = {
    {"set_on_step", Engine_set_on_step, METH_O, "set_on_step(fn)"},  // expect: per-step-python-callback
    {"forward", Engine_forward, METH_VARARGS, "forward(*args)"},
    {"build", Engine_build, METH_NOARGS, "build()"},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef engine_members[] = {
    {"progress", T_OBJECT_EX, offsetof(Engine, progress), 0, "a callable forward calls"},  // expect: per-step-python-callback
    {"steps", T_LONG, offsetof(Engine, steps), READONLY, "steps taken"},
    {nullptr, 0, 0, 0, nullptr}};

PyGetSetDef engine_getset[] = {
    {"on_evict", Engine_get_on_evict, Engine_set_on_evict, "a callable build reads", nullptr},  // expect: per-step-python-callback
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

}  // namespace corpus_c_api_module
