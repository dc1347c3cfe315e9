// Package keyring seals and opens secrets at rest (upstream credentials of
// deployments) with versioned AES-256-GCM keys from SLUICE_KEK. It is shared
// by both planes: the control plane seals, data planes open.
//
// A ciphertext names its key: "v<N>:" + 12-byte nonce + sealed bytes. New
// secrets use the highest version; every configured version opens, so a
// key can rotate. The key ring is independent of the admin token and the
// key pepper by construction: it is its own secret.
package keyring

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// KeySize is the key length in bytes (AES-256).
const KeySize = 32

// Ring is a set of versioned keys.
type Ring struct {
	versions []int // highest first
	aeads    map[int]cipher.AEAD
}

// Parse reads "VERSION:BASE64KEY[,VERSION:BASE64KEY]" where each key
// decodes (standard or URL base64) to 32 bytes. All problems are reported.
func Parse(s string) (*Ring, error) {
	r := &Ring{aeads: map[int]cipher.AEAD{}}
	var errs []error
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		v, k, ok := strings.Cut(part, ":")
		if !ok {
			errs = append(errs, errors.New("key ring entry: want VERSION:BASE64KEY"))
			continue
		}
		ver, err := strconv.Atoi(strings.TrimPrefix(v, "v"))
		if err != nil || ver <= 0 {
			errs = append(errs, fmt.Errorf("key ring version %q: want a positive integer", v))
			continue
		}
		if _, dup := r.aeads[ver]; dup {
			errs = append(errs, fmt.Errorf("key ring version %d given twice", ver))
			continue
		}
		key, err := base64.StdEncoding.DecodeString(k)
		if err != nil {
			key, err = base64.URLEncoding.DecodeString(k)
		}
		if err != nil || len(key) != KeySize {
			errs = append(errs, fmt.Errorf("key ring version %d: want %d bytes in base64", ver, KeySize))
			continue
		}
		block, _ := aes.NewCipher(key)
		aead, _ := cipher.NewGCM(block)
		r.aeads[ver] = aead
		r.versions = append(r.versions, ver)
	}
	if len(r.versions) == 0 && len(errs) == 0 {
		errs = append(errs, errors.New("no key given"))
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	sort.Sort(sort.Reverse(sort.IntSlice(r.versions)))
	return r, nil
}

// Current is the version new secrets are sealed with.
func (r *Ring) Current() int { return r.versions[0] }

// Seal encrypts plaintext under the current key.
func (r *Ring) Seal(plaintext []byte) []byte {
	v := r.Current()
	aead := r.aeads[v]
	nonce := make([]byte, aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		panic(err) // crypto/rand does not fail on supported platforms
	}
	out := []byte("v" + strconv.Itoa(v) + ":")
	out = append(out, nonce...)
	return aead.Seal(out, nonce, plaintext, []byte(strconv.Itoa(v)))
}

// ErrUnknownKey means the ciphertext names a key version this ring lacks.
var ErrUnknownKey = errors.New("ciphertext names a key version that is not configured")

// Open decrypts a ciphertext made by Seal.
func (r *Ring) Open(ct []byte) ([]byte, error) {
	if !bytes.HasPrefix(ct, []byte("v")) {
		return nil, errors.New("ciphertext has no key version")
	}
	i := bytes.IndexByte(ct, ':')
	if i < 0 {
		return nil, errors.New("ciphertext has no key version")
	}
	ver, err := strconv.Atoi(string(ct[1:i]))
	if err != nil {
		return nil, errors.New("ciphertext has a bad key version")
	}
	aead, ok := r.aeads[ver]
	if !ok {
		return nil, fmt.Errorf("%w (v%d)", ErrUnknownKey, ver)
	}
	rest := ct[i+1:]
	if len(rest) < aead.NonceSize()+aead.Overhead() {
		return nil, errors.New("ciphertext is truncated")
	}
	pt, err := aead.Open(nil, rest[:aead.NonceSize()], rest[aead.NonceSize():], []byte(strconv.Itoa(ver)))
	if err != nil {
		return nil, fmt.Errorf("ciphertext does not open with key v%d (wrong key or tampered)", ver)
	}
	return pt, nil
}
