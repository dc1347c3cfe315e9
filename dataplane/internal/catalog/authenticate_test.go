package catalog

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/dataplane/internal/authn"
	"github.com/sluicegw/sluice/internal/token"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
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

// newKey returns a key of org_a/team_a/user_a with a new token hashed
// under p's current pepper.
func newKey(t testing.TB, p *token.Peppers, id string) (*configv1.Key, string) {
	t.Helper()
	tok := token.Generate(token.KeyPrefix)
	h, v := p.HashCurrent(tok)
	return &configv1.Key{Id: id, OrgId: "org_a", TeamId: "team_a", UserId: "user_a", Hash: h, PepperVersion: int32(v)}, tok
}

func build(t testing.TB, keys ...*configv1.Key) *Catalog {
	t.Helper()
	c, err := FromSnapshot(&configv1.Snapshot{
		Version: 1, Orgs: []*configv1.Org{{Id: "org_a"}}, Teams: []*configv1.Team{{Id: "team_a", OrgId: "org_a"}},
		Users:   []*configv1.User{{Id: "user_a", OrgId: "org_a"}},
		Members: []*configv1.Member{{TeamId: "team_a", UserId: "user_a", OrgId: "org_a"}}, Keys: keys,
	}, 0, nil)
	require.NoError(t, err)
	return c
}

func TestAuthenticateCurrentToken(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	a, tokA := newKey(t, p, "key_a")
	b, tokB := newKey(t, p, "key_b")
	c := build(t, a, b)
	r, err := c.Authenticate(p, tokA, t0)
	require.NoError(t, err)
	require.Equal(t, "key_a", r.Key.GetId())
	require.NotNil(t, r.Member, "the owner's membership of the key's team is resolved")
	r, err = c.Authenticate(p, tokB, t0)
	require.NoError(t, err)
	require.Equal(t, "key_b", r.Key.GetId())
	_, err = c.Authenticate(p, token.Generate(token.KeyPrefix), t0)
	require.ErrorIs(t, err, authn.ErrUnknown)
}

func TestAuthenticateRejectsMalformedBeforeLookup(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	a, tok := newKey(t, p, "key_a")
	c := build(t, a)
	body := []byte(tok)
	i := len(token.KeyPrefix) + 5
	if body[i] == 'a' {
		body[i] = 'b'
	} else {
		body[i] = 'a'
	}
	_, err := c.Authenticate(p, string(body), t0)
	require.ErrorIs(t, err, authn.ErrMalformed)
	require.ErrorIs(t, err, token.ErrChecksum)
	for _, bad := range []string{"", "sk-sluice-", tok[:len(tok)-1], "sat-" + tok[len(token.KeyPrefix):], tok + "x", strings.ToUpper(tok)} {
		_, err := c.Authenticate(p, bad, t0)
		require.ErrorIs(t, err, authn.ErrMalformed, "%q", bad)
	}
}

func TestAuthenticateOldHashDuringGraceOnly(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	k, newTok := newKey(t, p, "key_a")
	oldTok := token.Generate(token.KeyPrefix)
	oldHash, v := p.HashCurrent(oldTok)
	deadline := t0.Add(time.Hour)
	k.OldHashes = []*configv1.OldHash{{Hash: oldHash, PepperVersion: int32(v), ValidUntil: timestamppb.New(deadline)}}
	c := build(t, k)
	r, err := c.Authenticate(p, oldTok, deadline.Add(-time.Microsecond))
	require.NoError(t, err)
	require.Equal(t, "key_a", r.Key.GetId())
	_, err = c.Authenticate(p, oldTok, deadline)
	require.ErrorIs(t, err, authn.ErrUnknown, "the grace ends at valid_until")
	_, err = c.Authenticate(p, newTok, deadline.Add(time.Hour))
	require.NoError(t, err)
}

func TestAuthenticateExpired(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	k, tok := newKey(t, p, "key_a")
	k.ExpireTime = timestamppb.New(t0.Add(time.Minute))
	c := build(t, k)
	_, err := c.Authenticate(p, tok, t0)
	require.NoError(t, err)
	r, err := c.Authenticate(p, tok, t0.Add(time.Minute))
	require.ErrorIs(t, err, authn.ErrExpired)
	require.Equal(t, "key_a", r.Key.GetId(), "the principal is returned for attribution")
}

func TestAuthenticateBlockedNamesWidestScope(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	k, tok := newKey(t, p, "key_a")
	c := build(t, k)
	steps := []struct {
		typ, scope string
	}{{"key", authn.ScopeKey}, {"user", authn.ScopeUser}, {"team", authn.ScopeTeam}, {"org", authn.ScopeOrg}}
	seq := uint64(0)
	for _, s := range steps {
		seq++
		var err error
		c, err = c.Apply(&configv1.Event{Seq: seq, Change: &configv1.Event_Block{Block: &configv1.BlockChange{ObjectType: s.typ, Id: map[string]string{
			"key": "key_a", "user": "user_a", "team": "team_a", "org": "org_a"}[s.typ], Blocked: true}}}, seq)
		require.NoError(t, err)
		_, err = c.Authenticate(p, tok, t0)
		var be *authn.BlockedError
		require.ErrorAs(t, err, &be)
		require.Equal(t, s.scope, be.Scope, "the widest blocked scope is named")
	}
	// Unblocking the org alone leaves the team block in force.
	c, err := c.Apply(&configv1.Event{Seq: 9, Change: &configv1.Event_Block{Block: &configv1.BlockChange{ObjectType: "org", Id: "org_a"}}}, 9)
	require.NoError(t, err)
	_, err = c.Authenticate(p, tok, t0)
	var be *authn.BlockedError
	require.ErrorAs(t, err, &be)
	require.Equal(t, authn.ScopeTeam, be.Scope)
}

func TestAuthenticateExpiryBeforeBlock(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	k, tok := newKey(t, p, "key_a")
	k.Blocked, k.ExpireTime = true, timestamppb.New(t0)
	_, err := build(t, k).Authenticate(p, tok, t0)
	require.ErrorIs(t, err, authn.ErrExpired, "an expired key is a 401 even when blocked")
}

func TestAuthenticateAcrossPepperVersions(t *testing.T) {
	t.Parallel()
	v1 := peppers(t, pepperV1)
	both := peppers(t, pepperV2+","+pepperV1)
	old, oldTok := newKey(t, v1, "key_old")
	cur, curTok := newKey(t, both, "key_new")
	require.EqualValues(t, 1, old.PepperVersion)
	require.EqualValues(t, 2, cur.PepperVersion)
	c := build(t, old, cur)
	r, err := c.Authenticate(both, oldTok, t0)
	require.NoError(t, err)
	require.Equal(t, "key_old", r.Key.GetId())
	r, err = c.Authenticate(both, curTok, t0)
	require.NoError(t, err)
	require.Equal(t, "key_new", r.Key.GetId())
	_, err = c.Authenticate(peppers(t, pepperV2), oldTok, t0)
	require.ErrorIs(t, err, authn.ErrUnknown, "a retired pepper's tokens stop working")
}

func TestDeletedChainMakesKeyUnknown(t *testing.T) {
	t.Parallel()
	p := peppers(t, pepperV1)
	k, tok := newKey(t, p, "key_a")
	c := build(t, k)
	c2, err := c.Apply(&configv1.Event{Seq: 1, Change: &configv1.Event_KeyDeleted{KeyDeleted: "key_a"}}, 1)
	require.NoError(t, err)
	_, err = c2.Authenticate(p, tok, t0)
	require.ErrorIs(t, err, authn.ErrUnknown)
	_, err = c.Authenticate(p, tok, t0)
	require.NoError(t, err, "the old catalog is unchanged (immutability)")
}

func FuzzAuthenticate(f *testing.F) {
	p := peppers(f, pepperV1)
	k, tok := newKey(f, p, "key_a")
	c := build(f, k)
	f.Add(tok)
	f.Add("")
	f.Add("sk-sluice-")
	f.Add(tok[:len(tok)-1] + "0")
	f.Add(token.Generate(token.KeyPrefix))
	f.Add(token.Generate(token.AdminPrefix))
	f.Fuzz(func(t *testing.T, s string) {
		r, err := c.Authenticate(p, s, t0)
		if s == tok {
			if err != nil || r.Key.GetId() != "key_a" {
				t.Fatalf("known token rejected: %v", err)
			}
			return
		}
		if err == nil {
			t.Fatalf("%q authenticated as %s", s, r.Key.GetId())
		}
		if !errors.Is(err, authn.ErrMalformed) && !errors.Is(err, authn.ErrUnknown) {
			t.Fatalf("unexpected error %v", err)
		}
	})
}
