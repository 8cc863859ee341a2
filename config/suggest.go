package config

import "sort"

// suggest returns the known key closest to s when it is close enough to be a
// likely typo, else "".
func suggest(s string, known []string) string {
	best, bestD := "", 1<<30
	for _, k := range known {
		if d := editDistance(s, k); d < bestD || (d == bestD && k < best) {
			best, bestD = k, d
		}
	}
	limit := 2
	if len(s) >= 12 {
		limit = len(s) / 4
	}
	if bestD <= limit {
		return best
	}
	return ""
}

// editDistance is the Levenshtein distance of a and b (bytes), bounded to
// inputs of reasonable size.
func editDistance(a, b string) int {
	if len(a) > 256 || len(b) > 256 {
		return 1 << 30
	}
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
