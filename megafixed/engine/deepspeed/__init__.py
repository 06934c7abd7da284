"""The DeepSpeed implementation of the engine seam (``megafixed.engine.base.Engine``): the only
package of megafixed that imports DeepSpeed. Its modules are reached through ``megafixed.engine``."""
