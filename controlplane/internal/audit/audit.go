// Package audit defines the audit trail's records, their canonical
// encoding and the hash chain over them (SPEC §5).
//
// Each record's hash is SHA-256 over a domain tag, the previous record's
// hash and every field of the record in a fixed order, each string
// length-prefixed, times as Unix microseconds (Postgres' precision). So a
// changed field, a removed, inserted or reordered record all break the
// chain at a place Verify can name. JSON bodies are hashed as the exact
// canonical bytes that are stored.
package audit

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"time"
)

// Actions recorded in the trail.
const (
	ActionCreated       = "created"
	ActionUpdated       = "updated"
	ActionDeleted       = "deleted"
	ActionBlocked       = "blocked"
	ActionUnblocked     = "unblocked"
	ActionRotated       = "rotated"
	ActionTokenCreated  = "token_created"
	ActionTokenRevoked  = "token_revoked"
	ActionMemberAdded   = "member_added"
	ActionMemberUpdated = "member_updated"
	ActionMemberRemoved = "member_removed"
	ActionPromoted      = "promoted"
	ActionRolledBack    = "rolled_back"
	// ActionGranted and ActionRevoked record a model group granted to an
	// org and taken away (object model_group_grant "<group>/<org>").
	ActionGranted = "granted"
	ActionRevoked = "revoked"
	// ActionEpochStarted: the publisher found JetStream ahead of the
	// database and renumbered distribution above it (docs/distribution.md).
	ActionEpochStarted = "epoch_started"
)

// domain separates this hash from any other SHA-256 use.
const domain = "sluice-audit-v1"

// ZeroHash is the prev_hash of the first record.
var ZeroHash = make([]byte, sha256.Size)

// Record is one audit record.
type Record struct {
	Seq        int64
	At         time.Time
	Actor      string
	TokenID    string
	Action     string
	ObjectType string
	ObjectID   string
	OrgID      string
	TeamID     string
	RequestID  string
	BeforeJSON string
	AfterJSON  string
	PrevHash   []byte
	Hash       []byte
}

// ComputeHash returns the hash of r chained to r.PrevHash.
func ComputeHash(r *Record) []byte {
	h := sha256.New()
	var buf [8]byte
	writeStr := func(s string) {
		binary.BigEndian.PutUint32(buf[:4], uint32(len(s)))
		h.Write(buf[:4])
		h.Write([]byte(s))
	}
	writeStr(domain)
	h.Write(r.PrevHash)
	binary.BigEndian.PutUint64(buf[:], uint64(r.Seq))
	h.Write(buf[:])
	binary.BigEndian.PutUint64(buf[:], uint64(r.At.UnixMicro()))
	h.Write(buf[:])
	for _, s := range []string{r.Actor, r.TokenID, r.Action, r.ObjectType, r.ObjectID, r.OrgID, r.TeamID, r.RequestID, r.BeforeJSON, r.AfterJSON} {
		writeStr(s)
	}
	return h.Sum(nil)
}

// Seal sets r's sequence number, previous hash and hash as the record
// after (prevSeq, prevHash). The time is truncated to microseconds.
func Seal(r *Record, prevSeq int64, prevHash []byte) {
	r.Seq = prevSeq + 1
	r.At = r.At.UTC().Truncate(time.Microsecond)
	r.PrevHash = append([]byte(nil), prevHash...)
	r.Hash = ComputeHash(r)
}

// Break describes the first broken link of a chain.
type Break struct {
	Seq     int64
	Problem string
}

// Verifier checks a chain fed to it record by record in sequence order.
type Verifier struct {
	prevSeq  int64
	prevHash []byte
	checked  int64
}

// NewVerifier starts a verification at the beginning of the chain.
func NewVerifier() *Verifier { return &Verifier{prevHash: ZeroHash} }

// ResumeVerifier continues a verification after record prevSeq, whose
// hash was prevHash (prevSeq 0 is the beginning of the chain).
func ResumeVerifier(prevSeq int64, prevHash []byte) *Verifier {
	if prevSeq == 0 {
		return NewVerifier()
	}
	return &Verifier{prevSeq: prevSeq, prevHash: append([]byte(nil), prevHash...)}
}

// Position returns the last record verified and its hash.
func (v *Verifier) Position() (int64, []byte) { return v.prevSeq, v.prevHash }

// CheckAlone checks one record without walking the chain to it: its hash
// over its contents and its link to the record before it, known only by
// that record's hash (predHash; nil when there is no such record). It is
// the check of a tenant's view, which sees only its own records.
func CheckAlone(r *Record, predHash []byte) *Break {
	if r.Seq == 1 {
		predHash = ZeroHash
	}
	switch {
	case predHash == nil:
		return &Break{Seq: r.Seq - 1, Problem: fmt.Sprintf("record %d (just before record %d) is missing", r.Seq-1, r.Seq)}
	case !bytes.Equal(r.PrevHash, predHash):
		return &Break{Seq: r.Seq, Problem: "prev_hash does not match the previous record's hash (record removed, inserted or reordered)"}
	case !bytes.Equal(ComputeHash(r), r.Hash):
		return &Break{Seq: r.Seq, Problem: "hash does not match the record's contents (record edited)"}
	}
	return nil
}

// Next checks r against the previous record. It returns nil if the link
// holds.
func (v *Verifier) Next(r *Record) *Break {
	switch {
	case r.Seq != v.prevSeq+1:
		return &Break{Seq: v.prevSeq + 1, Problem: fmt.Sprintf("record %d is missing (next record found is %d)", v.prevSeq+1, r.Seq)}
	case !bytes.Equal(r.PrevHash, v.prevHash):
		return &Break{Seq: r.Seq, Problem: "prev_hash does not match the previous record's hash (record removed, inserted or reordered)"}
	case !bytes.Equal(ComputeHash(r), r.Hash):
		return &Break{Seq: r.Seq, Problem: "hash does not match the record's contents (record edited)"}
	}
	v.prevSeq, v.prevHash = r.Seq, r.Hash
	v.checked++
	return nil
}

// End checks that the chain ends where the recorded head says it does, so
// removing the newest records is detected too.
func (v *Verifier) End(headSeq int64, headHash []byte) *Break {
	if headSeq != v.prevSeq {
		return &Break{Seq: v.prevSeq + 1, Problem: fmt.Sprintf("chain ends at %d but the head says %d (records removed at the end)", v.prevSeq, headSeq)}
	}
	if !bytes.Equal(headHash, v.prevHash) {
		return &Break{Seq: v.prevSeq, Problem: "last record's hash does not match the chain head"}
	}
	return nil
}

// Checked returns how many records verified so far.
func (v *Verifier) Checked() int64 { return v.checked }

// CanonicalJSON re-encodes a JSON document with sorted object keys and no
// insignificant whitespace, so equal values always hash equally. Empty
// input stays empty.
func CanonicalJSON(b []byte) (string, error) {
	if len(b) == 0 {
		return "", nil
	}
	var v any
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&v); err != nil {
		return "", fmt.Errorf("canonical json: %w", err)
	}
	out, err := json.Marshal(v)
	if err != nil {
		return "", fmt.Errorf("canonical json: %w", err)
	}
	return string(out), nil
}
