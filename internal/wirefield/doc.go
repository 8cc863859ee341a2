// Package wirefield reads and writes the bounded fields of kvxfer's own
// binary messages (the control frames of transceiver/internal/wire and
// the group messages of the transceiver): varints with a maximum, bytes
// behind a varint length, fixed-size bytes, booleans.
//
// A Decoder keeps the first error and reads nothing after it, so that a
// message's decoder reads every field in turn and checks once at the end;
// the error names the field and the byte where it failed, in the words of
// the message's own format (Decoder.Wrap). Every length and count is
// checked against a maximum before anything is allocated: a hostile peer
// cannot make a decoder allocate more than the message it sent.
package wirefield
