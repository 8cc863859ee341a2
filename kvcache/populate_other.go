//go:build !linux

package kvcache

// mapPopulate is Linux's alone: Populate is ignored elsewhere.
const mapPopulate = 0
