// The benign twins of c_api_module.cpp's cases, in a module written against CPython's C API: accepted. A callable
// kept only for a method that is not per-step, a per-step method that reads plain values out of its arguments, a
// callable used during the call that handed it over and then dropped, a writable member that holds no Python object,
// a read-only member and a property without a setter.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <cstddef>

namespace corpus_c_api_module_ok {

PyObject* g_logger = nullptr;  // kept, but only the non-step "log" calls it

struct Engine {
  PyObject_HEAD
  PyObject* name;  // set once by the type's constructor
  PyObject* tag;   // likewise: read-only from Python
  long steps;
  long block;
};

Engine* engine(PyObject* self) { return reinterpret_cast<Engine*>(self); }

PyObject* set_logger(PyObject*, PyObject* fn) {
  Py_XINCREF(fn);
  Py_XDECREF(g_logger);
  g_logger = fn;
  Py_RETURN_NONE;
}

PyObject* log(PyObject*, PyObject* message) { return PyObject_CallOneArg(g_logger, message); }

PyObject* apply(PyObject*, PyObject* args) {
  PyObject* fn = nullptr;
  PyObject* value = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &fn, &value)) return nullptr;
  return PyObject_CallOneArg(fn, value);  // calls what it was handed, keeps nothing: not per-step
}

PyObject* forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long total = 0;
  for (Py_ssize_t i = 0; i < nargs; ++i) total += PyLong_AsLong(args[i]);
  return PyLong_FromLong(total);
}

PyObject* Engine_forward(PyObject* self, PyObject* arg) {
  Engine* e = engine(self);
  e->steps += PyLong_AsLong(arg) + e->block + (e->tag == Py_None ? 0 : 1);
  return PyLong_FromLong(e->steps);
}

PyObject* Engine_get_name(PyObject* self, void*) { return Py_NewRef(engine(self)->name); }

PyMethodDef module_methods[] = {
    {"set_logger", set_logger, METH_O, "set_logger(fn)"},
    {"log", log, METH_O, "log(message): calls the logger."},
    {"apply", apply, METH_VARARGS, "apply(fn, value) -> fn(value)"},
    {"forward", _PyCFunction_CAST(forward), METH_FASTCALL, "forward(*ints) -> their sum"},
    {nullptr, nullptr, 0, nullptr}};

PyMethodDef engine_methods[] = {{"forward", Engine_forward, METH_O, "forward(n)"}, {nullptr, nullptr, 0, nullptr}};

PyMemberDef engine_members[] = {
    {"block", T_LONG, offsetof(Engine, block), 0, "block size"},
    {"tag", T_OBJECT_EX, offsetof(Engine, tag), READONLY, "a tag forward reads"},
    {nullptr, 0, 0, 0, nullptr}};

PyGetSetDef engine_getset[] = {{"name", Engine_get_name, nullptr, "the name", nullptr},
                               {nullptr, nullptr, nullptr, nullptr, nullptr}};

}  // namespace corpus_c_api_module_ok
