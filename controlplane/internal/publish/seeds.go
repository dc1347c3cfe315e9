package publish

import (
	"cmp"
	"context"
	"maps"
	"slices"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/budget"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// Budget seeds (SPEC §8.3). A data plane counts each budgeted scope's
// spend per window in Redis; when a counter is missing (first use of the
// scope in the window, or Redis lost its state) it starts it from the
// snapshot's seed for that scope and window instead of from zero.
//
// A seed is the ledger's spend (spend_logs, through spend_daily for whole
// days) of the scope in the budget window that contains the compile time,
// so it is exactly as fresh as the snapshot: it misses what the ledger
// recorded after the compile, and what the data planes had not yet
// delivered to the ledger at the compile (the usage pipeline's lag,
// normally about a second). Snapshots are compiled after every change
// (debounced, Config.Debounce/MaxDelay) and at least every
// SnapshotInterval (15 min by default), so a data plane that loses Redis
// may undercount a scope by the spend since the last compile. A seed of a
// window that has ended by the time it is used names its window start, so
// the data plane ignores it rather than carry old spend into a new window.

// hasBudget reports whether l carries a budget of its own (the model
// budgets are separate scopes).
func hasBudget(l *configv1.Limits) bool {
	return l.MaxBudget != nil || l.SoftBudget != nil
}

// seedPlan pairs each seed with the ledger scope its spend is read from.
type seedPlan struct {
	seeds  []*configv1.BudgetSeed
	scopes []store.BudgetScope
	// invalid counts budgets whose window does not parse (the admin API
	// never stores one; they get no seed).
	invalid int
}

// add plans a seed of scope sc (its Kind, ledger columns and OrgID set),
// seeded under id, for budget window w at now.
func (sp *seedPlan) add(sc store.BudgetScope, id, w string, now time.Time) {
	start, end, err := budget.Window(w, now)
	if err != nil {
		sp.invalid++
		return
	}
	sc.Start, sc.End = start, end
	sp.seeds = append(sp.seeds, &configv1.BudgetSeed{OrgId: sc.OrgID, Kind: sc.Kind, Id: id, Window: w, WindowStart: start.Unix()})
	sp.scopes = append(sp.scopes, sc)
}

// addModels plans the per-model budgets of a key or team (kind key_model
// or team_model), in model order, in the owner's window.
func (sp *seedPlan) addModels(l *configv1.Limits, kind, ownerID string, owner store.BudgetScope, now time.Time) {
	for _, group := range slices.Sorted(maps.Keys(l.GetModelMaxBudget())) {
		sc := owner
		sc.Kind, sc.ModelGroup = kind, group
		sp.add(sc, budget.ModelID(ownerID, group), l.GetBudgetDuration(), now)
	}
}

// planSeeds lists the seeds snap needs: every scope with a budget (hard or
// soft) gets one for the window containing now.
func planSeeds(snap *configv1.Snapshot, now time.Time) *seedPlan {
	sp := &seedPlan{}
	for _, o := range snap.GetOrgs() {
		if hasBudget(o.GetLimits()) {
			sp.add(store.BudgetScope{Kind: budget.KindOrg, OrgID: o.GetId()}, o.GetId(), o.GetLimits().GetBudgetDuration(), now)
		}
	}
	for _, t := range snap.GetTeams() {
		l := t.GetLimits()
		sc := store.BudgetScope{Kind: budget.KindTeam, OrgID: t.GetOrgId(), TeamID: t.GetId()}
		if hasBudget(l) {
			sp.add(sc, t.GetId(), l.GetBudgetDuration(), now)
		}
		sp.addModels(l, budget.KindTeamModel, t.GetId(), sc, now)
	}
	for _, u := range snap.GetUsers() {
		if hasBudget(u.GetLimits()) {
			sp.add(store.BudgetScope{Kind: budget.KindUser, OrgID: u.GetOrgId(), UserID: u.GetId()}, u.GetId(), u.GetLimits().GetBudgetDuration(), now)
		}
	}
	for _, m := range snap.GetMembers() {
		if m.MaxBudgetInTeam != nil || hasBudget(m.GetLimits()) {
			sp.add(store.BudgetScope{Kind: budget.KindMember, OrgID: m.GetOrgId(), TeamID: m.GetTeamId(), UserID: m.GetUserId()},
				budget.MemberID(m.GetTeamId(), m.GetUserId()), m.GetLimits().GetBudgetDuration(), now)
		}
	}
	for _, c := range snap.GetCustomers() {
		if hasBudget(c.GetLimits()) {
			sp.add(store.BudgetScope{Kind: budget.KindCustomer, OrgID: c.GetOrgId(), Customer: c.GetExternalId()}, c.GetId(), c.GetLimits().GetBudgetDuration(), now)
		}
	}
	for _, k := range snap.GetKeys() {
		l := k.GetLimits()
		sc := store.BudgetScope{Kind: budget.KindKey, OrgID: k.GetOrgId(), KeyID: k.GetId()}
		if hasBudget(l) {
			sp.add(sc, k.GetId(), l.GetBudgetDuration(), now)
		}
		sp.addModels(l, budget.KindKeyModel, k.GetId(), sc, now)
	}
	return sp
}

// budgetSeeds returns the seeds of snap compiled at now, sorted by kind
// and id. Scopes without recorded spend in their window get no seed: a
// data plane treats a missing seed as zero, and most budgeted scopes of a
// large snapshot have spent nothing yet.
func (p *Publisher) budgetSeeds(ctx context.Context, snap *configv1.Snapshot, now time.Time) ([]*configv1.BudgetSeed, error) {
	sp := planSeeds(snap, now)
	if sp.invalid > 0 {
		p.log.Warn("budgets with an invalid budget_duration get no seed", "count", sp.invalid)
	}
	if len(sp.scopes) == 0 {
		return nil, nil
	}
	spend, err := p.store.BudgetSpend(ctx, sp.scopes)
	if err != nil {
		return nil, err
	}
	out := make([]*configv1.BudgetSeed, 0, len(sp.seeds))
	for i, s := range sp.seeds {
		if s.SpendMicros = budget.Micros(spend[i]); s.SpendMicros > 0 {
			out = append(out, s)
		}
	}
	slices.SortFunc(out, func(a, b *configv1.BudgetSeed) int {
		return cmp.Or(cmp.Compare(a.Kind, b.Kind), cmp.Compare(a.Id, b.Id))
	})
	return out, nil
}
