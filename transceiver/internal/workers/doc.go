// Package workers holds the goroutines of a rank's sends and receives:
// a Pool that keeps finished goroutines for the next job, and a Group that
// counts what still touches a request's memory and runs a function when
// the last of them ends.
//
// A transfer's data-plane calls are deep: a goroutine started per send or
// receive grew its stack two or three times each time, and cost a start.
// A Pool's idle workers keep their grown stacks; the Group runs the end of
// a request on the goroutine of whoever finishes last, so that ending it
// costs no hand-off to a goroutine parked in Wait.
package workers
