package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
	"github.com/sluicegw/sluice/internal/budget"
)

// BudgetScope is one budgeted scope whose ledger spend in its budget window
// [Start, End) BudgetSpend sums. Kind is one of the budget.Kind constants;
// the other fields are the spend_logs columns the scope matches:
//
//	key        KeyID
//	user       UserID
//	member     TeamID and UserID
//	team       TeamID
//	org        OrgID
//	customer   OrgID and Customer (the customer's external id)
//	project    OrgID and Label (the project)
//	tag        OrgID and Label (the tag)
//	key_model  KeyID and ModelGroup
//	team_model TeamID and ModelGroup
//
// OrgID is the scope's org for every kind (the daily aggregates are kept
// per org).
type BudgetScope struct {
	Kind       string
	OrgID      string
	TeamID     string
	UserID     string
	KeyID      string
	Customer   string
	Label      string
	ModelGroup string
	Start, End time.Time
}

// budgetRanges splits a window [start, end) into what the daily
// aggregates answer, the whole UTC days [dayFrom, dayTo), and the partial
// days at its edges that only spend_logs answers, [start, dayFrom) and
// [dayTo, end). A window without a whole day gets dayFrom = dayTo (the
// logs cover all of it).
func budgetRanges(start, end time.Time) (dayFrom, dayTo time.Time) {
	start, end = start.UTC(), end.UTC()
	dayFrom, dayTo = utcDay(start), utcDay(end)
	if dayFrom.Before(start) {
		dayFrom = dayFrom.AddDate(0, 0, 1)
	}
	if dayTo.Before(dayFrom) {
		// Inside one day (10:00–11:00): no whole day, no midnight.
		return end, end
	}
	return dayFrom, dayTo
}

// windowArgs are the range arguments of the daily-aware queries.
type windowArgs struct {
	idx                                []int32
	starts, headEnds, tailStarts, ends []time.Time
	dayFroms, dayTos                   []pgtype.Date
}

func (w *windowArgs) add(i int, sc BudgetScope) {
	from, to := budgetRanges(sc.Start, sc.End)
	w.idx = append(w.idx, int32(i))
	w.starts = append(w.starts, sc.Start.UTC())
	w.headEnds = append(w.headEnds, from)
	w.dayFroms = append(w.dayFroms, pgDate(from))
	w.dayTos = append(w.dayTos, pgDate(to))
	w.tailStarts = append(w.tailStarts, to)
	w.ends = append(w.ends, sc.End.UTC())
}

// spendRow is a row of every BudgetSpend<Kind> query: the index of the
// scope in BudgetSpend's argument and its spend in USD.
type spendRow struct {
	Idx     int32
	CostUsd float64
}

// spendRows converts the rows of one BudgetSpend<Kind> query (sqlc gives
// each query its own row type, all of spendRow's shape).
func spendRows[R ~struct {
	Idx     int32
	CostUsd float64
}](rs []R, err error) ([]spendRow, error) {
	out := make([]spendRow, len(rs))
	for i, r := range rs {
		out[i] = spendRow(r)
	}
	return out, err
}

// BudgetSpend returns the ledger spend in USD of every scope in its window
// (out[i] is scopes[i]'s): one query per kind of scope, so its cost grows
// with the number of budgeted scopes, not with the number of keys. For
// the kinds spend_daily aggregates, whole UTC days come from it and only
// the partial days at a window's edges from spend_logs, so a monthly
// budget does not rescan the month's requests (see sql/queries/budgets.sql).
func (s *Store) BudgetSpend(ctx context.Context, scopes []BudgetScope) ([]float64, error) {
	out := make([]float64, len(scopes))
	byKind := map[string][]int{}
	for i, sc := range scopes {
		byKind[sc.Kind] = append(byKind[sc.Kind], i)
	}
	for kind, idxs := range byKind {
		var w windowArgs
		for _, i := range idxs {
			w.add(i, scopes[i])
		}
		from, to := w.dayFroms, w.dayTos
		var rows []spendRow
		var err error
		field := func(f func(BudgetScope) string) []string {
			v := make([]string, len(idxs))
			for j, i := range idxs {
				v[j] = f(scopes[i])
			}
			return v
		}
		switch kind {
		case budget.KindKey:
			rows, err = spendRows(s.q.BudgetSpendKey(ctx, s.pool, dbsqlc.BudgetSpendKeyParams{
				Idx: w.idx, Ids: field(func(b BudgetScope) string { return b.KeyID }), OrgIds: field(func(b BudgetScope) string { return b.OrgID }),
				StartAts: w.starts, HeadEnds: w.headEnds, DayFroms: from, DayTos: to, TailStarts: w.tailStarts, EndAts: w.ends,
			}))
		case budget.KindUser:
			rows, err = spendRows(s.q.BudgetSpendUser(ctx, s.pool, dbsqlc.BudgetSpendUserParams{
				Idx: w.idx, Ids: field(func(b BudgetScope) string { return b.UserID }), OrgIds: field(func(b BudgetScope) string { return b.OrgID }),
				StartAts: w.starts, HeadEnds: w.headEnds, DayFroms: from, DayTos: to, TailStarts: w.tailStarts, EndAts: w.ends,
			}))
		case budget.KindTeam:
			rows, err = spendRows(s.q.BudgetSpendTeam(ctx, s.pool, dbsqlc.BudgetSpendTeamParams{
				Idx: w.idx, Ids: field(func(b BudgetScope) string { return b.TeamID }), OrgIds: field(func(b BudgetScope) string { return b.OrgID }),
				StartAts: w.starts, HeadEnds: w.headEnds, DayFroms: from, DayTos: to, TailStarts: w.tailStarts, EndAts: w.ends,
			}))
		case budget.KindOrg:
			rows, err = spendRows(s.q.BudgetSpendOrg(ctx, s.pool, dbsqlc.BudgetSpendOrgParams{
				Idx: w.idx, Ids: field(func(b BudgetScope) string { return b.OrgID }),
				StartAts: w.starts, HeadEnds: w.headEnds, DayFroms: from, DayTos: to, TailStarts: w.tailStarts, EndAts: w.ends,
			}))
		case budget.KindCustomer:
			rows, err = spendRows(s.q.BudgetSpendCustomer(ctx, s.pool, dbsqlc.BudgetSpendCustomerParams{
				Idx: w.idx, OrgIds: field(func(b BudgetScope) string { return b.OrgID }), ExternalIds: field(func(b BudgetScope) string { return b.Customer }),
				StartAts: w.starts, HeadEnds: w.headEnds, DayFroms: from, DayTos: to, TailStarts: w.tailStarts, EndAts: w.ends,
			}))
		case budget.KindProject:
			rows, err = spendRows(s.q.BudgetSpendProject(ctx, s.pool, dbsqlc.BudgetSpendProjectParams{
				Idx: w.idx, OrgIds: field(func(b BudgetScope) string { return b.OrgID }), Names: field(func(b BudgetScope) string { return b.Label }),
				StartAts: w.starts, HeadEnds: w.headEnds, DayFroms: from, DayTos: to, TailStarts: w.tailStarts, EndAts: w.ends,
			}))
		case budget.KindTag:
			rows, err = spendRows(s.q.BudgetSpendTag(ctx, s.pool, dbsqlc.BudgetSpendTagParams{
				Idx: w.idx, OrgIds: field(func(b BudgetScope) string { return b.OrgID }), Names: field(func(b BudgetScope) string { return b.Label }),
				StartAts: w.starts, HeadEnds: w.headEnds, DayFroms: from, DayTos: to, TailStarts: w.tailStarts, EndAts: w.ends,
			}))
		case budget.KindMember:
			rows, err = spendRows(s.q.BudgetSpendMember(ctx, s.pool, dbsqlc.BudgetSpendMemberParams{
				Idx: w.idx, TeamIds: field(func(b BudgetScope) string { return b.TeamID }), UserIds: field(func(b BudgetScope) string { return b.UserID }),
				StartAts: w.starts, EndAts: w.ends,
			}))
		case budget.KindKeyModel:
			rows, err = spendRows(s.q.BudgetSpendKeyModel(ctx, s.pool, dbsqlc.BudgetSpendKeyModelParams{
				Idx: w.idx, KeyIds: field(func(b BudgetScope) string { return b.KeyID }), ModelGroups: field(func(b BudgetScope) string { return b.ModelGroup }),
				StartAts: w.starts, EndAts: w.ends,
			}))
		case budget.KindTeamModel:
			rows, err = spendRows(s.q.BudgetSpendTeamModel(ctx, s.pool, dbsqlc.BudgetSpendTeamModelParams{
				Idx: w.idx, TeamIds: field(func(b BudgetScope) string { return b.TeamID }), ModelGroups: field(func(b BudgetScope) string { return b.ModelGroup }),
				StartAts: w.starts, EndAts: w.ends,
			}))
		default:
			return nil, fmt.Errorf("budget spend: unknown scope kind %q", kind)
		}
		if err != nil {
			return nil, fmt.Errorf("sum ledger spend of %d %s budgets: %w", len(idxs), kind, err)
		}
		for _, r := range rows {
			if int(r.Idx) < 0 || int(r.Idx) >= len(out) {
				return nil, fmt.Errorf("sum ledger spend of %s budgets: index %d out of range", kind, r.Idx)
			}
			out[r.Idx] = r.CostUsd
		}
	}
	return out, nil
}
