// Package connect opens the membership store a disagg_cluster block names
// and derives the Member and View settings from the block: the one place
// where config's typed block meets the membership package, so that the
// router and the workers read it the same way.
package connect
