// Package ids makes the identifiers of Sluice objects: a type prefix and a
// UUIDv7 in lower-case hex ("key_01936c5e4b2f7a8c9d0e1f2a3b4c5d6e"). UUIDv7
// starts with a millisecond timestamp, so ids sort by creation time and
// keyset pagination by id follows creation order.
package ids

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"time"
)

// Prefixes of the object types.
const (
	Org        = "org"
	Team       = "team"
	User       = "user"
	Key        = "key"
	Customer   = "cus"
	AdminToken = "tok"
	Issuer     = "iss"
	Webhook    = "whk"
	LabelScope = "lsc"
)

// New returns a new identifier with the given prefix.
func New(prefix string) string {
	var u [16]byte
	ms := uint64(time.Now().UnixMilli())
	binary.BigEndian.PutUint64(u[0:8], ms<<16)
	if _, err := rand.Read(u[6:]); err != nil {
		// crypto/rand never fails on supported platforms (Go 1.24+ crashes
		// the program itself rather than return an error).
		panic(err)
	}
	u[6] = (u[6] & 0x0f) | 0x70 // version 7
	u[8] = (u[8] & 0x3f) | 0x80 // variant 10
	return prefix + "_" + hex.EncodeToString(u[:])
}

// Valid reports whether id looks like an identifier with the given prefix.
func Valid(prefix, id string) bool {
	if len(id) != len(prefix)+1+32 || id[:len(prefix)+1] != prefix+"_" {
		return false
	}
	for _, c := range id[len(prefix)+1:] {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}
