# Concatenates the files in INPUTS (a list) into OUTPUT.
file(WRITE ${OUTPUT} "")
foreach(f IN LISTS INPUTS)
  file(READ ${f} content)
  file(APPEND ${OUTPUT} "${content}")
endforeach()
