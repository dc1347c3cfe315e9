package authn

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/token"
)

const (
	pepperV1 = "1:pepper-one-0123456789abcdefghijklmnopqrstuvwxyz"
	pepperV2 = "2:pepper-two-0123456789abcdefghijklmnopqrstuvwxyz"
)

var t0 = time.Date(2026, 11, 1, 12, 0, 0, 0, time.UTC)

func peppers(t testing.TB, spec string) *token.Peppers {
	t.Helper()
	p, err := token.ParsePeppers(spec)
	require.NoError(t, err)
	return p
}

// record returns a record for a new token hashed under p's current pepper.
func record(t testing.TB, p *token.Peppers, id string) (Record, string) {
	t.Helper()
	tok := token.Generate(token.KeyPrefix)
	h, v := p.HashCurrent(tok)
	return Record{KeyID: id, OrgID: "org_a", Hash: h, PepperVersion: v}, tok
}

func TestAuthenticateCurrentToken(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	a, tokA := record(t, p, "key_a")
	b, tokB := record(t, p, "key_b")
	idx := NewIndex([]Record{a, b})
	require.Equal(t, 2, idx.Len())

	r, err := idx.Authenticate(p, tokA, t0)
	require.NoError(t, err)
	require.Equal(t, "key_a", r.KeyID)
	r, err = idx.Authenticate(p, tokB, t0)
	require.NoError(t, err)
	require.Equal(t, "key_b", r.KeyID)

	_, err = idx.Authenticate(p, token.Generate(token.KeyPrefix), t0)
	require.ErrorIs(t, err, ErrUnknown)
}

func TestAuthenticateRejectsMalformedBeforeLookup(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	a, tok := record(t, p, "key_a")
	idx := NewIndex([]Record{a})

	// A one-character typo fails the checksum.
	body := []byte(tok)
	i := len(token.KeyPrefix) + 5
	if body[i] == 'a' {
		body[i] = 'b'
	} else {
		body[i] = 'a'
	}
	_, err := idx.Authenticate(p, string(body), t0)
	require.ErrorIs(t, err, ErrMalformed)
	require.ErrorIs(t, err, token.ErrChecksum)

	for _, bad := range []string{"", "sk-sluice-", tok[:len(tok)-1], "sat-" + tok[len(token.KeyPrefix):], tok + "x", strings.ToUpper(tok)} {
		_, err := idx.Authenticate(p, bad, t0)
		require.ErrorIs(t, err, ErrMalformed, "%q", bad)
	}
}

func TestAuthenticateOldHashDuringGraceOnly(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	cur, newTok := record(t, p, "key_a")
	oldTok := token.Generate(token.KeyPrefix)
	oldHash, v := p.HashCurrent(oldTok)
	deadline := t0.Add(time.Hour)
	cur.OldHashes = []OldHash{{Hash: oldHash, PepperVersion: v, ValidUntil: deadline}}
	idx := NewIndex([]Record{cur})

	r, err := idx.Authenticate(p, oldTok, deadline.Add(-time.Nanosecond))
	require.NoError(t, err)
	require.Equal(t, "key_a", r.KeyID)

	_, err = idx.Authenticate(p, oldTok, deadline)
	require.ErrorIs(t, err, ErrUnknown, "the grace ends at valid_until")

	r, err = idx.Authenticate(p, newTok, deadline.Add(time.Hour))
	require.NoError(t, err)
	require.Equal(t, "key_a", r.KeyID)
}

func TestAuthenticateExpired(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	a, tok := record(t, p, "key_a")
	a.ExpiresAt = t0.Add(time.Minute)
	idx := NewIndex([]Record{a})

	_, err := idx.Authenticate(p, tok, t0)
	require.NoError(t, err)
	r, err := idx.Authenticate(p, tok, t0.Add(time.Minute))
	require.ErrorIs(t, err, ErrExpired)
	require.Equal(t, "key_a", r.KeyID, "the record is returned for attribution")
}

func TestAuthenticateBlockedNamesScope(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	for _, scope := range []string{ScopeKey, ScopeUser, ScopeTeam, ScopeOrg} {
		a, tok := record(t, p, "key_a")
		a.BlockedScope = scope
		r, err := NewIndex([]Record{a}).Authenticate(p, tok, t0)
		var be *BlockedError
		require.ErrorAs(t, err, &be)
		require.Equal(t, scope, be.Scope)
		require.Contains(t, be.Error(), scope)
		require.Equal(t, "key_a", r.KeyID)
	}
}

func TestAuthenticateExpiryBeforeBlock(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	a, tok := record(t, p, "key_a")
	a.BlockedScope, a.ExpiresAt = ScopeTeam, t0
	_, err := NewIndex([]Record{a}).Authenticate(p, tok, t0)
	require.ErrorIs(t, err, ErrExpired, "an expired key is a 401 even when blocked")
}

func TestAuthenticateAcrossPepperVersions(t *testing.T) {
	t.Parallel()
	v1 := peppers(t, pepperV1)
	both := peppers(t, pepperV2+","+pepperV1)
	old, oldTok := record(t, v1, "key_old") // issued before pepper 2 existed
	cur, curTok := record(t, both, "key_new")
	require.Equal(t, 1, old.PepperVersion)
	require.Equal(t, 2, cur.PepperVersion)
	idx := NewIndex([]Record{old, cur})

	r, err := idx.Authenticate(both, oldTok, t0)
	require.NoError(t, err)
	require.Equal(t, "key_old", r.KeyID)
	r, err = idx.Authenticate(both, curTok, t0)
	require.NoError(t, err)
	require.Equal(t, "key_new", r.KeyID)

	// Once pepper 1 is retired, tokens hashed under it no longer work.
	_, err = idx.Authenticate(peppers(t, pepperV2), oldTok, t0)
	require.ErrorIs(t, err, ErrUnknown)

	// A record claiming another version than its hash was made with is
	// not matched.
	wrong := old
	wrong.PepperVersion = 2
	_, err = NewIndex([]Record{wrong}).Authenticate(both, oldTok, t0)
	require.ErrorIs(t, err, ErrUnknown)
}

func TestCurrentHashWinsOverOldHash(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	a, tok := record(t, p, "key_a")
	b, _ := record(t, p, "key_b")
	b.OldHashes = []OldHash{{Hash: a.Hash, PepperVersion: a.PepperVersion, ValidUntil: t0.Add(-time.Hour)}}
	r, err := NewIndex([]Record{b, a}).Authenticate(p, tok, t0)
	require.NoError(t, err)
	require.Equal(t, "key_a", r.KeyID)
}

func FuzzAuthenticate(f *testing.F) {
	p := peppers(f, pepperV1)
	a, tok := record(f, p, "key_a")
	idx := NewIndex([]Record{a})
	f.Add(tok)
	f.Add("")
	f.Add("sk-sluice-")
	f.Add(tok[:len(tok)-1] + "0")
	f.Add(token.Generate(token.KeyPrefix))
	f.Add(token.Generate(token.AdminPrefix))
	f.Fuzz(func(t *testing.T, s string) {
		r, err := idx.Authenticate(p, s, t0)
		if s == tok {
			if err != nil || r.KeyID != "key_a" {
				t.Fatalf("known token rejected: %v", err)
			}
			return
		}
		if err == nil {
			t.Fatalf("%q authenticated as %s", s, r.KeyID)
		}
		if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrUnknown) {
			t.Fatalf("unexpected error %v", err)
		}
	})
}
