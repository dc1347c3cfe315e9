package gateway

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/limits"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestScopesCachedPerCatalog: a request's limit scopes are built once per
// catalog (the same slice for the next request of the key), equal what
// limitScopes builds, and a new snapshot's catalog (limits changed) builds
// them anew; a JWT principal's are never cached.
func TestScopesCachedPerCatalog(t *testing.T) {
	e := newEnv(t)
	e.snap.Orgs[0].Limits = &configv1.Limits{RpmLimit: ptr[int64](5000)}
	e.key("k1", func(k *configv1.Key) {
		k.Limits = &configv1.Limits{TpmLimit: ptr[int64](100_000), MaxBudget: ptr(10.0), BudgetDuration: "1d"}
	})
	e.apply()
	scopesOf := func(keyID string) ([]limitsScopeView, *exchange) {
		cat := e.cat.Load()
		p, err := cat.KeyPrincipal(keyID, time.Now())
		require.NoError(t, err)
		x := &exchange{h: e.h, cat: cat, p: p, group: "m"}
		got := x.scopes()
		require.Equal(t, limitScopes(p, nil, nil, "m", e.h.cfg.RateFallbackDefault), exportedScopes(got))
		return viewScopes(got), x
	}
	first, x := scopesOf("k1")
	require.Equal(t, []limitsScopeView{{"key", "k1", 0, 100_000, 10_000_000}, {"org", "o1", 5000, 0, 0}}, first)
	a, b := x.scopes(), x.scopes()
	require.Same(t, &a[0], &b[0], "the second request of the catalog reuses the scopes")
	require.True(t, x.scopesChecked, "cached scopes were checked once, when cached (limits.Request.ScopesChecked)")

	// A new snapshot lowers the key's tpm: its catalog's scopes carry it.
	e.snap.Keys[0].Limits.TpmLimit = ptr[int64](50_000)
	e.apply()
	second, _ := scopesOf("k1")
	require.Equal(t, []limitsScopeView{{"key", "k1", 0, 50_000, 10_000_000}, {"org", "o1", 5000, 0, 0}}, second)

	// A JWT's principal (a key of its own per request) is not cached.
	cat := e.cat.Load()
	p, err := cat.KeyPrincipal("k1", time.Now())
	require.NoError(t, err)
	jp := *p
	jp.Key = &configv1.Key{Id: "jwt:issuer", OrgId: "o1"}
	jx := &exchange{h: e.h, cat: cat, p: &jp, group: "m"}
	c, d := jx.scopes(), jx.scopes()
	require.Len(t, c, 1)
	require.NotSame(t, &c[0], &d[0])
	require.False(t, jx.scopesChecked, "a JWT's scopes are checked by each admission")
}

// exportedScopes copies scopes without what limits.PrepareScopes adds
// (their slots).
func exportedScopes(scopes []limits.Scope) []limits.Scope {
	out := make([]limits.Scope, len(scopes))
	for i, s := range scopes {
		out[i] = limits.Scope{Kind: s.Kind, ID: s.ID, RPM: s.RPM, TPM: s.TPM, MaxParallel: s.MaxParallel, Budget: s.Budget,
			LocalFallback: s.LocalFallback}
	}
	return out
}

type limitsScopeView struct {
	kind, id    string
	rpm, tpm    int64
	budgetMicro int64
}

func viewScopes(ss []limits.Scope) []limitsScopeView {
	var out []limitsScopeView
	for _, s := range ss {
		v := limitsScopeView{s.Kind, s.ID, s.RPM, s.TPM, 0}
		if s.Budget != nil {
			v.budgetMicro = s.Budget.CapMicros
		}
		out = append(out, v)
	}
	return out
}
