// Package token makes, checks and hashes Sluice secrets: virtual keys
// ("sk-sluice-...") and admin tokens ("sat-..."). It is shared by both
// planes: the control plane hashes tokens it issues, the data plane hashes
// tokens it receives, and neither ever stores a token.
//
// A token is prefix + body + checksum. The body is 256 bits from
// crypto/rand in base62 (43 characters); the checksum is the CRC-32 (IEEE)
// of prefix+body in base62 (6 characters), as GitHub tokens do, so a typo
// or a scanner hit is recognised without a lookup. Stored hashes are
// HMAC-SHA256 under a versioned server-side pepper (see Peppers).
package token

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"io"
	"math/big"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// Token prefixes.
const (
	KeyPrefix   = "sk-sluice-"
	AdminPrefix = "sat-"
)

const (
	bodyLen     = 43 // base62 digits of a 256-bit number
	checksumLen = 6  // base62 digits of a 32-bit number
	alphabet    = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
	// MinPepperLen is the shortest pepper secret accepted, in bytes.
	MinPepperLen = 32
)

// Errors returned by Check.
var (
	ErrMalformed = errors.New("token is malformed")
	ErrChecksum  = errors.New("token checksum does not match")
)

// Generate returns a new token with the given prefix.
func Generate(prefix string) string {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand does not fail on supported platforms
	}
	body := base62(new(big.Int).SetBytes(b[:]), bodyLen)
	return prefix + body + checksum(prefix+body)
}

// Check verifies the shape and checksum of tok, which must start with
// prefix. It does no lookup and takes constant work for a given length.
func Check(prefix, tok string) error {
	if len(tok) != len(prefix)+bodyLen+checksumLen || !strings.HasPrefix(tok, prefix) {
		return ErrMalformed
	}
	rest := tok[len(prefix):]
	for i := 0; i < len(rest); i++ {
		if strings.IndexByte(alphabet, rest[i]) < 0 {
			return ErrMalformed
		}
	}
	body := rest[:bodyLen]
	if subtle.ConstantTimeCompare([]byte(checksum(prefix+body)), []byte(rest[bodyLen:])) != 1 {
		return ErrChecksum
	}
	return nil
}

// DisplayPrefix returns the part of tok kept for humans: the prefix and
// the first 4 characters of the body.
func DisplayPrefix(prefix, tok string) string {
	n := len(prefix) + 4
	if len(tok) < n {
		return ""
	}
	return tok[:n]
}

// Last4 returns the last 4 characters of tok.
func Last4(tok string) string {
	if len(tok) < 4 {
		return ""
	}
	return tok[len(tok)-4:]
}

func checksum(s string) string {
	return base62Uint(uint64(crc32.ChecksumIEEE([]byte(s))), checksumLen)
}

// base62Uint is base62 of a small number, without math/big (every key
// check computes one).
func base62Uint(n uint64, width int) string {
	var out [16]byte
	for i := width - 1; i >= 0; i-- {
		out[i] = alphabet[n%62]
		n /= 62
	}
	return string(out[:width])
}

func base62(n *big.Int, width int) string {
	out := make([]byte, width)
	base := big.NewInt(62)
	mod := new(big.Int)
	for i := width - 1; i >= 0; i-- {
		n.DivMod(n, base, mod)
		out[i] = alphabet[mod.Int64()]
	}
	return string(out)
}

// Pepper is one version of the server-side HMAC secret.
type Pepper struct {
	Version int
	Secret  []byte
}

// Peppers is the set of pepper versions a server knows. New hashes use the
// highest version; lookups try every version, so a pepper can rotate:
// add a new version, rehash keys as they rotate, retire the old one.
type Peppers struct {
	list []Pepper // highest version first
	// macs holds, per entry of list, keyed HMAC states for reuse (one
	// hmac.New per token hashed costs two SHA-256 blocks and five
	// allocations on every authenticated request).
	macs []*sync.Pool
}

// ParsePeppers parses "VERSION:SECRET[,VERSION:SECRET...]", for example
// "2:...,1:...". Versions are positive integers, unique; every secret is at
// least MinPepperLen bytes. All problems are reported at once.
func ParsePeppers(s string) (*Peppers, error) {
	var errs []error
	p := &Peppers{}
	seen := map[int]bool{}
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		v, secret, ok := strings.Cut(part, ":")
		if !ok {
			errs = append(errs, fmt.Errorf("pepper entry %d: want VERSION:SECRET", len(p.list)+len(errs)+1))
			continue
		}
		ver, err := strconv.Atoi(strings.TrimPrefix(v, "v"))
		if err != nil || ver <= 0 {
			errs = append(errs, fmt.Errorf("pepper version %q: want a positive integer", v))
			continue
		}
		if seen[ver] {
			errs = append(errs, fmt.Errorf("pepper version %d given twice", ver))
			continue
		}
		if len(secret) < MinPepperLen {
			errs = append(errs, fmt.Errorf("pepper version %d: secret is %d bytes, want at least %d", ver, len(secret), MinPepperLen))
			continue
		}
		seen[ver] = true
		p.list = append(p.list, Pepper{Version: ver, Secret: []byte(secret)})
	}
	if len(p.list) == 0 && len(errs) == 0 {
		errs = append(errs, errors.New("no pepper given"))
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	sort.Slice(p.list, func(i, j int) bool { return p.list[i].Version > p.list[j].Version })
	for _, pp := range p.list {
		secret := pp.Secret
		p.macs = append(p.macs, &sync.Pool{New: func() any { return hmac.New(sha256.New, secret) }})
	}
	return p, nil
}

// Current returns the version used for new hashes.
func (p *Peppers) Current() int { return p.list[0].Version }

// Versions returns the known versions, highest first.
func (p *Peppers) Versions() []int {
	out := make([]int, len(p.list))
	for i, pp := range p.list {
		out[i] = pp.Version
	}
	return out
}

// Hash returns HMAC-SHA256 of tok under the given pepper version.
func (p *Peppers) Hash(version int, tok string) ([]byte, error) {
	for i, pp := range p.list {
		if pp.Version == version {
			pool := p.macs[i]
			m := pool.Get().(hash.Hash)
			m.Reset()
			_, _ = io.WriteString(m, tok)
			sum := m.Sum(make([]byte, 0, sha256.Size))
			pool.Put(m)
			return sum, nil
		}
	}
	return nil, fmt.Errorf("pepper version %d is not configured", version)
}

// HashCurrent returns the hash of tok under the current pepper and that
// version.
func (p *Peppers) HashCurrent(tok string) ([]byte, int) {
	h, _ := p.Hash(p.Current(), tok)
	return h, p.Current()
}

// Candidate is the hash of a presented token under one pepper version.
type Candidate struct {
	Version int
	Hash    []byte
}

// Candidates returns the hash of tok under every known pepper version,
// current first: a lookup tries each, so tokens issued under an older
// pepper keep working while it is configured.
func (p *Peppers) Candidates(tok string) []Candidate {
	out := make([]Candidate, 0, len(p.list))
	for _, pp := range p.list {
		h, _ := p.Hash(pp.Version, tok)
		out = append(out, Candidate{Version: pp.Version, Hash: h})
	}
	return out
}

// Equal compares two hashes in constant time.
func Equal(a, b []byte) bool { return subtle.ConstantTimeCompare(a, b) == 1 }
